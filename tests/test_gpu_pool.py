"""The device pool on its own, in virtual time: recording callbacks, a gated backend, no
batcher and no HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from batchserve.batching.faults import PROBE_INPUT, BatchFailure, FailureKind
from batchserve.batching.request import QueuedRequest, Result
from batchserve.clock import FakeClock
from batchserve.devices.loading import WARM_UP_INPUT
from batchserve.errors import StartupError
from batchserve.gpu_pool import GpuPool
from batchserve.models.backends import POISON_MARKER
from batchserve.models.registry import Key
from batchserve.models.specs import BatchFn

from .conftest import HANG_GUARD_S, Factory, GatedBackend, sim_version, until


@dataclass
class Heard:
    """What the pool told its callbacks, in order."""

    events: list[tuple[str, object]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def batch_done(self, batch: list[QueuedRequest], started: float, finished: float) -> None:
        self._hear("done", (finished, len(batch)))

    def batch_failed(self, batch: list[QueuedRequest], key: Key, failure: BatchFailure) -> None:
        self._hear("failed", (len(batch), failure.kind))

    def health_changed(self) -> None:
        self._hear("health", None)

    def idle_started(self, key: Key, batch: list[QueuedRequest]) -> int:
        self._hear("started", [request.input for request in batch])
        return len(self.events)

    def idle_withdrawn(self, key: Key, batch: list[QueuedRequest]) -> None:
        self._hear("withdrawn", [request.input for request in batch])

    def hooks(self) -> dict[str, Any]:
        """The pool's callbacks, as the batcher hands them over."""
        return {
            "batch_done": self.batch_done,
            "batch_failed": self.batch_failed,
            "health_changed": self.health_changed,
            "idle_started": self.idle_started,
            "idle_withdrawn": self.idle_withdrawn,
        }

    def _hear(self, kind: str, detail: object) -> None:
        self.events.append((kind, detail))
        self.changed.set()

    async def next(self) -> tuple[str, object]:
        """Waits for the next event after those already seen."""
        seen = len(self.events)
        while len(self.events) == seen:
            self.changed.clear()
            await self.changed.wait()
        return self.events[seen]


def crash(task: str, error: BaseException) -> None:
    raise AssertionError(f"{task} crashed: {error!r}")


@pytest.fixture
async def pool_of(gated: GatedBackend) -> AsyncIterator[Callable[..., object]]:
    """Starts a pool of `devices` over `factory` (default: the gated backend)."""
    pools: list[GpuPool] = []

    async def start(
        devices: int = 1, factory: Factory | None = None, budget_s: float = 0.5
    ) -> tuple[GpuPool, Heard, FakeClock]:
        clock, heard = FakeClock(), Heard()
        version = sim_version(
            factory or gated, devices=f"sim:{devices}", batch_timeout_ms=budget_s * 1e3
        )
        pool = GpuPool([version], clock=clock, on_crash=crash, **heard.hooks())
        await pool.__aenter__()
        pools.append(pool)
        return pool, heard, clock

    yield start
    for pool in pools:
        await pool.__aexit__(None, None, None)


def batch_of(pool: GpuPool, clock: FakeClock, *texts: str) -> tuple[list[QueuedRequest], Key]:
    """Requests for the pool's one model version, and their key."""
    loop = asyncio.get_running_loop()
    now = clock.time()
    key = next(iter(pool.devices[0].fns)).plain_key
    return [QueuedRequest(t, t, now, now + 60, loop.create_future(), key) for t in texts], key


async def behind_the_calls_on(pool: GpuPool, name: str) -> None:
    """Returns once the calls submitted to the device's thread have returned and the loop
    has handled their outcomes: its thread runs calls in order, and hands each outcome back
    in order, so a no-op submitted now comes back after theirs."""
    [device] = [d for d in pool.devices if d.name == name]
    await device.thread.submit(lambda _: None, None)


async def test_a_batch_runs_on_a_free_device_and_is_timed_on_the_engine_clock(pool_of, gated):
    pool, heard, clock = await pool_of(devices=2)
    batch, key = batch_of(pool, clock, "ab", "cd")
    clock.advance(0.010)  # queued 10 ms
    pool.dispatch(batch, 7, key)
    assert (pool.free_count, pool.in_flight_requests) == (1, 2)
    clock.advance(0.100)  # the call takes 100 ms of virtual time
    gated.gate.set()
    assert await heard.next() == ("done", (clock.time(), 2))
    results = [await request.future for request in batch]
    assert results == [
        Result("ba", pytest.approx(0.010), pytest.approx(0.100), 2, 7, "sim:0"),
        Result("dc", pytest.approx(0.010), pytest.approx(0.100), 2, 7, "sim:0"),
    ]
    assert pool.free_count == 2
    assert pool.devices[0].busy_total_s == pytest.approx(0.100)


async def test_closing_withdraws_a_prepared_call_and_its_device_never_starts_it(pool_of, gated):
    pool, heard, clock = await pool_of()
    first, key = batch_of(pool, clock, "a")
    then, _ = batch_of(pool, clock, "b")
    pool.dispatch(first, 1, key, "idle")
    [device] = pool.devices
    assert pool.prepared.prepare(device, key, then)
    await gated.entered("sim:0")
    await pool.__aexit__(None, None, None)
    assert heard.events == [("withdrawn", ["b"])]  # back to the idle tier, not started
    gated.gate.set()
    await device.thread.join(HANG_GUARD_S)
    assert gated.seen_inputs() == ["a"]


async def test_a_malformed_result_answers_nobody_and_goes_back_to_the_batcher(pool_of, gated):
    gated.gate.set()
    gated.malformed_calls = 1
    pool, heard, clock = await pool_of()
    batch, key = batch_of(pool, clock, "x", "y")
    pool.dispatch(batch, 1, key)
    assert await heard.next() == ("failed", (2, FailureKind.MALFORMED))
    assert not any(request.future.done() for request in batch)
    assert pool.faults["batch_malformed"] == 1


async def test_a_call_past_its_budget_hangs_the_device_until_a_probe_answers(pool_of, gated):
    gated.gate.set()
    gated.stuck = {"sim:0"}
    pool, heard, clock = await pool_of(budget_s=0.5)
    batch, key = batch_of(pool, clock, "x")
    pool.dispatch(batch, 1, key)
    clock.advance(0.499)
    assert heard.events == []
    clock.advance(0.001)  # the watchdog fires at exactly the budget
    assert heard.events == [("failed", (1, FailureKind.HUNG)), ("health", None)]
    assert (pool.states(), pool.healthy, pool.free_count) == ({"sim:0": "hung"}, 0, 0)
    gated.stuck.clear()
    gated.unstick.set()  # the wedged call returns; its result is dropped
    await behind_the_calls_on(pool, "sim:0")
    assert pool.states()["sim:0"] == "recovering"
    assert not batch[0].future.done()
    assert pool.faults["late_result_discarded"] == 1
    clock.advance(0.5)  # the back-off (one budget) ends: the probe runs
    assert await heard.next() == ("health", None)
    assert (pool.states(), pool.healthy) == ({"sim:0": "idle"}, 1)
    assert gated.calls_on("sim:0") == [["x"], [PROBE_INPUT]]


async def test_two_failed_calls_in_a_row_make_a_device_suspect_until_its_probe_answers(
    pool_of, gated
):
    """Two poison inputs in a row, on different inputs: the second failure hands its batch
    back to be moved whole, and the device takes no work until its probe answers."""
    pool, heard, clock = await pool_of()
    gated.gate.set()
    for text in [f"a{POISON_MARKER}", f"b{POISON_MARKER}"]:
        batch, key = batch_of(pool, clock, text)
        pool.dispatch(batch, 1, key)
        await heard.next()
    assert heard.events[-1] == ("failed", (1, FailureKind.SUSPECT_DEVICE))
    assert await heard.next() == ("health", None)  # the probe answered
    assert (pool.states(), pool.healthy, pool.free_count) == ({"sim:0": "idle"}, 1, 1)
    assert pool.faults["device_cleared"] == 1
    assert gated.calls_on("sim:0")[-1] == [PROBE_INPUT]


async def test_first_tries_failing_on_every_device_make_none_suspect(pool_of, gated):
    """A flood of poison inputs fails first tries everywhere: a device's second failure in
    a row, with another device's between them, is put down to inputs, not to the device."""
    pool, heard, clock = await pool_of(devices=2)
    gated.gate.set()

    async def fails(text: str) -> object:
        batch, key = batch_of(pool, clock, text + POISON_MARKER)
        pool.dispatch(batch, 1, key)
        return await heard.next()

    assert await fails("a") == ("failed", (1, FailureKind.RAISED))  # on sim:0
    gated.stuck = {"sim:0"}
    held, key = batch_of(pool, clock, "h" + POISON_MARKER)
    pool.dispatch(held, 2, key)  # sim:0 holds it
    await gated.entered("sim:0")
    assert await fails("b") == ("failed", (1, FailureKind.RAISED))  # on sim:1
    gated.stuck.clear()
    gated.unstick.set()
    assert await heard.next() == ("failed", (1, FailureKind.RAISED))  # sim:0's second
    assert pool.states() == {"sim:0": "idle", "sim:1": "idle"}


async def test_a_suspect_device_that_fails_its_probe_restarts(pool_of, gated):
    pool, heard, clock = await pool_of(devices=2)
    gated.gate.set()
    gated.broken = {"sim:0"}
    for text in ["a", "b"]:
        batch, key = batch_of(pool, clock, text)
        pool.dispatch(batch, 1, key)  # sim:0, the first free device
        await heard.next()
    assert heard.events[-1] == ("failed", (1, FailureKind.SUSPECT_DEVICE))
    assert await heard.next() == ("health", None)  # the probe failed: out, restarting
    assert pool.states()["sim:0"] == "failing"
    assert (pool.healthy, pool.faults["device_failing"]) == (1, 1)


async def test_devices_that_fail_to_load_are_dead_and_none_loading_stops_start_up(pool_of):
    def half_broken(device: str):
        if device == "sim:1":
            raise RuntimeError("no weights")
        return lambda inputs: inputs

    pool, _, _ = await pool_of(devices=2, factory=half_broken)
    assert (pool.states(), pool.healthy) == ({"sim:0": "idle", "sim:1": "dead"}, 1)
    with pytest.raises(StartupError, match="device sim:0 failed to load: RuntimeError: gone"):
        await pool_of(factory=lambda device: (_ for _ in ()).throw(RuntimeError("gone")))


async def test_a_live_added_versions_warm_up_waits_for_the_devices_turn(pool_of, gated):
    """The warm-up batch of a version added while serving runs on the device's own thread
    once the batch inside has returned, never beside it (one call per device at a time)."""
    pool, heard, clock = await pool_of(devices=1)
    batch, key = batch_of(pool, clock, "ab")
    pool.dispatch(batch, 1, key)
    await gated.entered("sim:0")
    added = sim_version(gated, devices="sim:1")
    loading = asyncio.ensure_future(pool.load(added, beside_serving=True))
    [device] = pool.devices
    # Polled: the load runs its factory on a thread, which nothing on the loop announces.
    await until(lambda: bool(getattr(device, "turns", ())) or len(gated.calls) >= 2)
    calls_meanwhile = list(gated.calls)
    gated.gate.set()  # before any assertion: a failed test must not leave a thread blocked
    assert await loading == []
    assert calls_meanwhile == [("sim:0", ["ab"])]  # the warm-up waited for its turn
    assert await batch[0].future == Result("ba", 0.0, 0.0, 1, 1, "sim:0")
    assert gated.calls == [("sim:0", ["ab"]), ("sim:0", [WARM_UP_INPUT])]
    assert gated.max_concurrent == {"sim:0": 1}
    assert (added.loaded_on, pool.free_count) == (["sim:0"], 1)
    assert heard.events[-1] == ("health", None)  # the batcher hears the device is free


async def test_a_device_whose_warm_up_fails_does_not_take_the_version(pool_of, gated):
    gated.gate.set()
    pool, _, _ = await pool_of(devices=2)

    def no_kernels(inputs: list[str]) -> list[str]:
        raise RuntimeError("no kernels for this device")

    def picky(device: str) -> BatchFn:
        return no_kernels if device == "sim:1" else gated(device)

    added = sim_version(picky, devices="sim:2")
    problems = await pool.load(added, beside_serving=True)
    assert problems == [
        "device sim:1 failed to load: its warm-up batch failed: RuntimeError: no kernels for"
        " this device"
    ]
    assert added.loaded_on == ["sim:0"]
    assert [added in device.fns for device in pool.devices] == [True, False]
    assert (pool.states(), pool.free_for(added)) == ({"sim:0": "idle", "sim:1": "idle"}, 1)


@dataclass
class HeardRunning(Heard):
    """Also notes, as each failed batch comes back, whether its requests read as running."""

    running: list[list[bool]] = field(default_factory=list)

    def batch_failed(self, batch: list[QueuedRequest], key: Key, failure: BatchFailure) -> None:
        self.running.append([request.running for request in batch])
        super().batch_failed(batch, key, failure)


async def test_the_pool_alone_says_whether_a_request_is_running(gated):
    """`running` has one writer: the pool sets it at dispatch and clears it before it hands
    a failed batch back, so the batcher gets the batch as queued again."""
    gated.gate.set()
    gated.malformed_calls = 1
    clock, heard = FakeClock(), HeardRunning()
    pool = GpuPool([sim_version(gated)], clock=clock, on_crash=crash, **heard.hooks())
    async with pool:
        batch, key = batch_of(pool, clock, "x", "y")
        pool.dispatch(batch, 1, key)
        assert [request.running for request in batch] == [True, True]
        assert await heard.next() == ("failed", (2, FailureKind.MALFORMED))
        assert heard.running == [[False, False]]
