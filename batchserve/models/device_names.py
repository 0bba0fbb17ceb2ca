"""Turns a --devices spec into device names, importing torch only for CUDA specs."""

from __future__ import annotations

import importlib
import re

from ..errors import StartupError

_SIM = re.compile(r"sim:(\d+)")
_CUDA = re.compile(r"cuda:(\d+)")


def parse_devices(spec: str) -> list[str]:
    """`sim:N`, `cpu`, `cuda` (every visible GPU) or a comma list like `cuda:0,cuda:2`."""
    spec = spec.strip()
    if sim := _SIM.fullmatch(spec):
        count = int(sim.group(1))
        if not 1 <= count <= 256:
            raise StartupError(f"--devices {spec}: the simulated device count must be 1 to 256")
        return [f"sim:{index}" for index in range(count)]
    if spec == "cpu":
        return ["cpu"]
    if spec == "cuda":
        return [f"cuda:{index}" for index in range(_visible_cuda_count(spec))]
    names = [part.strip() for part in spec.split(",")]
    if not names or not all(_CUDA.fullmatch(name) for name in names):
        raise StartupError(
            f"--devices {spec!r}: expected sim:N, cpu, cuda or a list like cuda:0,cuda:2"
        )
    if len(set(names)) != len(names):
        raise StartupError(f"--devices {spec}: a device is named twice")
    visible = _visible_cuda_count(spec)
    missing = [name for name in names if int(name.split(":")[1]) >= visible]
    if missing:
        raise StartupError(
            f"--devices {spec}: torch sees {visible} CUDA device(s), so {', '.join(missing)}"
            " does not exist"
        )
    return names


def _visible_cuda_count(spec: str) -> int:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        raise StartupError(
            f"--devices {spec} needs torch, which is not installed"
            " (pip install 'batchserve[torch]')"
        ) from None
    count = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    if count == 0:
        raise StartupError(f"--devices {spec}: torch is installed but sees no CUDA device")
    return count
