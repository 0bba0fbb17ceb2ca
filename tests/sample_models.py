"""User backends that the tests load by path, as `--fn` and `--fn-per-device` would."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import orjson
import torch


def shout(inputs: list[str]) -> list[str]:
    return [text.upper() for text in inputs]


def tagged(device: str):
    """A per-device factory: each device's outputs name the device that made them."""

    def run(inputs: list[str]) -> list[str]:
        return [f"{device}:{text}" for text in inputs]

    return run


def broken(device: str):
    raise RuntimeError("no weights found")


def not_a_function(device: str):
    return 42


class TinyModel(torch.nn.Module):
    """A real torch model: scores each input's bytes, answers with the best class index."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.linear = torch.nn.Linear(16, 4)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(4, 16, generator=generator))
            self.linear.bias.zero_()

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.linear(batch).argmax(dim=1)


def encode(inputs: list[str]) -> torch.Tensor:
    rows = [list(text.encode()[:16].ljust(16, b"\0")) for text in inputs]
    return torch.tensor(rows, dtype=torch.float32) / 255.0


def torch_model(device: str):
    """Loads the model once onto `device`; each call runs one batched forward pass."""
    model = TinyModel().to(device).eval()

    def run(inputs: list[str]) -> list[str]:
        with torch.inference_mode():
            classes = model(encode(inputs).to(device))
        return [str(int(label)) for label in classes.cpu()]

    return run


def torch_shift(device: str):
    """Moves each input's code points through `device` and back, each shifted up by one.

    Unlike the classifier above, every input gets an output that only it could produce, so a
    test can tell whether answers were mixed up.
    """
    torch.ones(1, device=device)  # the device's context is made here, at load time

    def run(inputs: list[str]) -> list[str]:
        width = max(len(text) for text in inputs)
        codes = torch.tensor(
            [[ord(char) for char in text] + [0] * (width - len(text)) for text in inputs],
            dtype=torch.int64,
        )
        shifted = (codes.to(device) + 1).cpu().tolist()
        return [
            "".join(map(chr, row[: len(text)])) for row, text in zip(shifted, inputs, strict=True)
        ]

    return run


def cuda_spinner(device: str):
    """Shifts like `torch_shift`, but an input carrying "!spin!" first spins the GPU for about
    two seconds: a real CUDA call that runs past any short batch budget."""
    shift = torch_shift(device)

    def run(inputs: list[str]) -> list[str]:
        if any("!spin!" in text for text in inputs):
            torch.cuda._sleep(4_000_000_000)  # GPU clock cycles, about 2 s on an H100
            torch.cuda.synchronize(device)
        return shift(inputs)

    return run


def fifo_gated(device: str):
    """Each call says 'entered' on one FIFO, then waits for one byte on another.

    Lets a test that runs the real process know a batch is inside the device, without
    sleeping, and decide when it finishes: n bytes written release the next n calls (a
    byte, not a line, since a buffered reader would swallow the lines meant for later calls).
    """
    folder = Path(os.environ["BATCHSERVE_TEST_FIFOS"])

    def run(inputs: list[str]) -> list[str]:
        with open(folder / "entered", "w") as entered:
            entered.write(f"{len(inputs)}\n")
        release = os.open(folder / "release", os.O_RDONLY)
        try:
            os.read(release, 1)
        finally:
            os.close(release)
        return [text[::-1] for text in inputs]

    return run


def _key_echo(label: str):
    """A batch function that answers each input with the version and params of the call
    that carried it, so a test can tell whether a call ever mixed compatibility keys."""

    def run(inputs: list[str], **params: object) -> list[str]:
        shown = orjson.dumps(params, option=orjson.OPT_SORT_KEYS).decode() if params else ""
        return [f"{label}|{shown}|{text}" for text in inputs]

    return run


key_echo_a1 = _key_echo("a@1")
key_echo_a2 = _key_echo("a@2")
key_echo_b1 = _key_echo("b@1")


def scaled(inputs: list[str], *, factor: int = 1) -> list[str]:
    """Takes one named param: each input repeated `factor` times."""
    return [text * factor for text in inputs]


def vectors(inputs: list[str]) -> list[list[float]]:
    """Any JSON value may be an output: here a short vector per input."""
    return [[float(len(text)), 1.0] for text in inputs]


class TinyEmbedder:
    """An embedding model in miniature: a 3-vector per input, tokens counted by words."""

    embedding_dim = 3

    def __call__(self, inputs: list[str]) -> list[list[float]]:
        return [[float(len(text)), float(text.count("a")), 0.5] for text in inputs]

    def count_tokens(self, text: str) -> int:
        return len(text.split())


def tiny_embedder(device: str) -> TinyEmbedder:
    return TinyEmbedder()


LOAD_GATE = threading.Event()
"""Holds `slow_to_load` until a test sets it, so the test sees a version while it loads."""


def slow_to_load(device: str):
    assert LOAD_GATE.wait(60), "the test never let the load finish"
    return key_echo_a2


HOLD_ENTERED = threading.Event()
"""Set once `held_a2` has a batch holding the input "hold" inside a device."""
HOLD_RELEASE = threading.Event()
"""Lets that batch finish; a test sets it (and clears both before it holds another)."""


def held_a2(device: str):
    """`key_echo_a2`, except that a batch holding the input "hold" stays inside the device
    until HOLD_RELEASE is set: a test sees a request in flight and decides when it ends."""

    def run(inputs: list[str], **params: object) -> list[str]:
        if "hold" in inputs:
            HOLD_ENTERED.set()
            assert HOLD_RELEASE.wait(60), "the test never let the held batch finish"
        return key_echo_a2(inputs, **params)

    return run


def cold_on_sim1(device: str):
    """Loads everywhere, but its first call (the warm-up of a version added live) raises on
    sim:1, and every call raises on a device named in BATCHSERVE_TEST_COLD (all: "*")."""
    cold = os.environ.get("BATCHSERVE_TEST_COLD", "sim:1")

    def run(inputs: list[str]) -> list[str]:
        if cold in ("*", device):
            raise RuntimeError(f"no kernels for {device}")
        return [f"warm|{text}" for text in inputs]

    return run
