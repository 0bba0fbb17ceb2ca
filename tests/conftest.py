"""Fakes and fixtures: a gated backend the test releases, an in-process server, a real one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import settings as hypothesis_settings

from batchserve.clock import Clock
from batchserve.config import Config
from batchserve.devices.health import DeviceState
from batchserve.engine.core import Engine, EngineStats
from batchserve.models.backends import POISON_MARKER, simulate
from batchserve.models.registry import Key, ModelVersion, build_version
from batchserve.models.specs import BatchFn, default_spec
from batchserve.rules.policy import Policy
from batchserve.server import AppRunner, create_app

from . import tiny_llama

# No example has a time limit: a garbage-collection pause or a busy machine must not fail a
# property test (hypothesis's default deadline is 200 ms an example).
hypothesis_settings.register_profile("batchserve", deadline=None)
hypothesis_settings.load_profile("batchserve")

Factory = Callable[[str], BatchFn]


def sim_version(factory: Factory | None = None, **settings: object) -> ModelVersion:
    """The default model version that `Config(**settings)` describes, not yet loaded."""
    config = Config(**settings)  # type: ignore[arg-type]
    return build_version(config, default_spec(config), fn_per_device=factory)


PLAIN_KEY = Key(sim_version())
"""A compatibility key for requests that no device runs (queue and fault-rule tests)."""


@dataclass
class GatedBackend:
    """A device factory whose calls block until `gate` opens; it records every call.

    It also counts how many calls are inside each device at once, so a test can prove a
    device never ran two batches together. Faults on demand: an input carrying the poison
    marker makes its call raise, devices named in `stuck` hang until `unstick` is set, and
    the first `malformed_calls` calls answer one output short, and every call on a device
    named in `broken` raises (a GPU that fell off the bus). `loads` counts the factory's
    calls per device: a restart loads again.
    """

    gate: threading.Event = field(default_factory=threading.Event)
    stuck: set[str] = field(default_factory=set)
    unstick: threading.Event = field(default_factory=threading.Event)
    malformed_calls: int = 0
    broken: set[str] = field(default_factory=set)
    loads: Counter[str] = field(default_factory=Counter)
    calls: list[tuple[str, list[str]]] = field(default_factory=list)
    max_concurrent: dict[str, int] = field(default_factory=dict)
    _inside: dict[str, int] = field(default_factory=dict)
    _entered: dict[str, threading.Event] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, device: str) -> BatchFn:
        self.loads[device] += 1

        def run(inputs: list[str]) -> list[str]:
            with self._lock:
                self.calls.append((device, list(inputs)))
                self._inside[device] = self._inside.get(device, 0) + 1
                self.max_concurrent[device] = max(
                    self.max_concurrent.get(device, 0), self._inside[device]
                )
                malformed = len(self.calls) <= self.malformed_calls
                self._entered.setdefault(device, threading.Event()).set()
            try:
                self.gate.wait()
                if device in self.stuck:
                    self.unstick.wait()
                if device in self.broken:
                    raise RuntimeError(f"{device} fell off the bus")
                if any(POISON_MARKER in text for text in inputs):
                    raise ValueError("this batch holds a poison input")
                outputs = [simulate(text) for text in inputs]
                return outputs[:-1] if malformed else outputs
            finally:
                with self._lock:
                    self._inside[device] -= 1

        return run

    async def entered(self, device: str) -> None:
        """Returns once a call has entered `device` (its thread runs it, not just queued)."""
        with self._lock:
            event = self._entered.setdefault(device, threading.Event())
        assert await asyncio.to_thread(event.wait, HANG_GUARD_S), f"nothing entered {device}"

    def seen_inputs(self) -> list[str]:
        return [text for _, inputs in self.calls for text in inputs]

    def calls_on(self, device: str) -> list[list[str]]:
        return [inputs for name, inputs in self.calls if name == device]


@pytest.fixture(scope="session", autouse=True)
def weights_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Real generators keep their converted GGUF copies (SmolLM2's: 540 MB) in a folder of
    the test run's, removed at its end, not in the user's cache; servers started by the tests
    inherit it."""
    yield from run_folder(tmp_path_factory, "XDG_CACHE_HOME", "xdg-cache")


@pytest.fixture(scope="session", autouse=True)
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The compiled layers' kernels (inductor's cache) likewise: every run compiles from
    nothing, as on a fresh machine, and leaves nothing in /tmp/torchinductor_$USER."""
    yield from run_folder(tmp_path_factory, "TORCHINDUCTOR_CACHE_DIR", "inductor-cache")


def run_folder(factory: pytest.TempPathFactory, variable: str, name: str) -> Iterator[Path]:
    """A folder of the test run's named by environment `variable`, removed at its end."""
    folder = factory.mktemp(name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(variable, str(folder))
        yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def gated() -> Iterator[GatedBackend]:
    backend = GatedBackend()
    yield backend
    backend.gate.set()  # never leave a device thread blocked behind a failed test
    backend.unstick.set()


class BatchserveTestServer(TestServer):
    """Serves the app with server.py's `AppRunner`, as `python -m batchserve` does."""

    async def _make_runner(self, **kwargs: object) -> AppRunner:
        return AppRunner(self.app, **kwargs)


@pytest.fixture
def start_server(
    aiohttp_client: Callable[..., object],
) -> Callable[..., object]:
    """Starts the real app over an engine in-process; returns (client, engine)."""

    async def start(
        factory: Factory,
        devices: int = 1,
        clock: Clock | None = None,
        policy: Policy | None = None,
        **settings: object,
    ) -> tuple[TestClient, Engine]:
        config = Config(**settings)  # type: ignore[arg-type]
        engine = Engine(
            config, fn_per_device=factory, devices=f"sim:{devices}", clock=clock, policy=policy
        )
        client = await aiohttp_client(  # type: ignore[operator]
            BatchserveTestServer(create_app(engine))
        )
        return client, engine

    return start


TWO_TENANT_KEYS = """
[keys."sk-alice"]
tenant = "alice"
tier = "paid"

[keys."sk-bob"]
tenant = "bob"
tier = "paid"
"""
"""A keys file of two paid tenants, alice (sk-alice) and bob (sk-bob)."""

HANG_GUARD_S = 60.0
"""A wait for a state that never comes fails the test after this long instead of hanging
the suite; no test relies on it as a timing."""


async def reach(engine: Engine, predicate: Callable[[EngineStats], bool]) -> None:
    """`engine.view.wait_until`, bounded: fails with the engine's state if it never holds."""
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            await engine.view.wait_until(predicate)
    except TimeoutError:
        pytest.fail(f"the engine never reached the state; it is {engine.stats()}")


async def until(holds: Callable[[], bool]) -> None:
    """Waits until `holds()`, checked on every loop pass: for a state that follows a
    thread's work, which nothing on the loop announces. Bounded by the hang guard (then
    TimeoutError), not by a count of loop passes, which a slow machine can run through
    before the thread is done."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not holds():  # noqa: ASYNC110
            await asyncio.sleep(0)


async def polled(engine: Engine, holds: Callable[[], bool], what: str) -> None:
    """`until(holds)`, failing with the devices' states if it never holds."""
    try:
        await until(holds)
    except TimeoutError:
        pytest.fail(f"never {what}; the devices are {engine.device_states()}")


async def recovering(engine: Engine, device: str) -> None:
    """Waits until the wedged call on `device` has returned (its thread, in real time) and
    its probe back-off has begun on the engine's clock."""
    await polled(engine, lambda: engine.device_states()[device] == "recovering",
                 f"{device} began recovering")  # fmt: skip


async def idle(engine: Engine, device: str) -> None:
    """Waits until `device` has no call inside (a release or a step may still be on its
    thread after the loop has moved on): a test that moves the fake clock past a call's
    budget first waits for this, or the watchdog judges that call hung."""
    await polled(engine, lambda: engine._devices.get(device).state is DeviceState.IDLE,
                 f"{device} became idle")  # fmt: skip


async def hold_one_and_queue_one(
    client: TestClient, engine: Engine
) -> tuple[asyncio.Future[ClientResponse], asyncio.Future[ClientResponse]]:
    """Posts "a", which a closed gate holds on the device, then "b", which waits queued behind
    it: a queue of one, filled, for tests of what the next request gets."""
    running = asyncio.ensure_future(client.post("/api/inference", json={"input": "a"}))
    await reach(engine, lambda s: s.in_flight == 1)
    queued = asyncio.ensure_future(client.post("/api/inference", json={"input": "b"}))
    await reach(engine, lambda s: s.queued == 1)
    return running, queued


ROOT = Path(__file__).resolve().parent.parent


class RealServer(NamedTuple):
    process: asyncio.subprocess.Process
    banner: str
    url: str


@contextlib.asynccontextmanager
async def real_server(
    *args: str, env: dict[str, str] | None = None, stderr: int | None = None
) -> AsyncIterator[RealServer]:
    """`python -m batchserve --port 0 ARGS` as a user runs it, once it has printed its banner.
    `stderr=asyncio.subprocess.PIPE` lets a test read its log (and then it must, or the
    server blocks on a full pipe).

    Killed on the way out if the test has not already seen it exit.
    """
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "batchserve", "--port", "0", *args,
        cwd=ROOT, env={**os.environ, **(env or {})}, stdout=asyncio.subprocess.PIPE,
        stderr=stderr,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        banner = (await process.stdout.readline()).decode()
        assert banner.startswith("batchserve listening on "), banner
        yield RealServer(process, banner, banner.split()[3])
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny Llama's tokenizer (tiny_llama.py), for the tests of real generators."""
    return tiny_llama.tokenizer()


@pytest.fixture(scope="module")
def tiny(tok: Any) -> Any:
    """The tiny Llama built from its seed."""
    return tiny_llama.model(len(tok), tok.eos_token_id)
