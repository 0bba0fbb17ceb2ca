"""Faults end to end, in-process: poison inputs, malformed results, hung and dead devices.

Hangs are real (a device thread blocks on an event the test sets); the watchdog runs on a
FakeClock that the test moves past the budget, so no assertion depends on how fast
anything runs.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
from collections.abc import Callable

import pytest
from aiohttp.test_utils import TestClient

from batchserve.batching.faults import PROBE_INPUT
from batchserve.batching.request import Result
from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.devices.loading import WARM_UP_INPUT
from batchserve.engine.core import Engine
from batchserve.engine.requests import Caller
from batchserve.errors import BackendError
from batchserve.models.backends import POISON_MARKER, simulate
from batchserve.rules.tenants import Tenant

from .conftest import HANG_GUARD_S, GatedBackend, polled, reach, recovering


async def ask(client: TestClient, text: str) -> tuple[int, dict[str, object]]:
    response = await client.post("/api/inference", json={"input": text})
    return response.status, await response.json()


async def fill_one_batch(
    client: TestClient, engine: Engine, backend: GatedBackend, texts: list[str]
) -> list[tuple[int, dict[str, object]]]:
    """Holds the device with a first request so that `texts` leave together, as one batch.

    At most 99 texts: the test client opens at most 100 connections at once.
    """
    first = asyncio.ensure_future(ask(client, "first"))
    await reach(engine, lambda s: s.in_flight == 1)
    answers = [asyncio.ensure_future(ask(client, text)) for text in texts]
    await reach(engine, lambda s: s.queued == len(texts))
    backend.gate.set()
    assert (await first)[0] == 200
    return list(await asyncio.gather(*answers))


async def test_poison_inputs_fail_alone_and_the_rest_of_their_batch_succeeds(start_server, gated):
    client, engine = await start_server(gated, retry_reserve=100)  # isolating 3 takes ~30
    texts = [f"in-{n}" + (POISON_MARKER if n in {3, 40, 41} else "") for n in range(99)]
    answers = await fill_one_batch(client, engine, gated, texts)
    for text, (status, body) in zip(texts, answers, strict=True):
        if POISON_MARKER in text:
            assert status == 500
            assert body["error"] == "BACKEND_ERROR"
            assert body["message"] == (
                "the batch function raised ValueError: this batch holds a poison input"
            )
        else:
            assert status == 200
            assert body["output"] == simulate(text)
    retries = len(gated.calls) - 2  # the first request's call and the whole batch's
    assert 0 < retries <= 2 * math.ceil(math.log2(99)) * 3
    assert engine.recoveries["failed"] == 3
    assert engine.faults["batch_raised"] > 0
    assert engine.stats().pending == 0


async def test_the_default_retry_reserve_isolates_a_poison_input_in_a_full_batch(
    start_server, gated, caplog
):
    client, engine = await start_server(gated)
    texts = [f"in-{n}" + (POISON_MARKER if n == 77 else "") for n in range(99)]
    answers = await fill_one_batch(client, engine, gated, texts)
    assert [status for status, _ in answers] == [200] * 77 + [500] + [200] * 21
    whole_batch = next(r.getMessage() for r in caplog.records if "batch 2 of 99" in r.getMessage())
    assert whole_batch.endswith(" and 94 more")  # five ids, then a count: lines stay short
    assert len(whole_batch) < 400


async def test_without_bisection_one_poison_input_fails_its_whole_batch(start_server, gated):
    client, engine = await start_server(gated, bisect_failures=False)
    texts = [f"in-{n}" + (POISON_MARKER if n == 5 else "") for n in range(10)]
    answers = await fill_one_batch(client, engine, gated, texts)
    assert [status for status, _ in answers] == [500] * 10
    assert len(gated.calls) == 2


async def test_idle_devices_rescue_every_innocent_request_of_a_burst_without_a_budget(gated):
    """500 requests at once on two devices, 5 of them poison, and no retry budget at all:
    once the fresh batches have gone the devices would idle, so they run every rescue."""
    gated.gate.set()
    config = Config(retry_budget=0, retry_reserve=0)
    async with Engine(config, fn_per_device=gated, devices="sim:2", clock=FakeClock()) as engine:
        texts = [f"in-{n}" + (POISON_MARKER if n % 100 == 7 else "") for n in range(500)]
        results = await asyncio.gather(*map(engine.infer, texts), return_exceptions=True)
        for text, result in zip(texts, results, strict=True):
            if POISON_MARKER in text:
                assert isinstance(result, BackendError)
            else:
                assert isinstance(result, Result)
                assert result.output == simulate(text)
        assert engine.recoveries["poison_isolated"] == 5
        assert engine.recoveries["failed"] == 5


async def test_a_rescue_the_budget_cannot_pay_for_waits_while_a_full_batch_waits(gated):
    config = Config(retry_budget=0, retry_reserve=0, max_batch_size=4)
    async with Engine(config, fn_per_device=gated, devices="sim:1", clock=FakeClock()) as engine:
        first = engine.submit("first")
        await gated.entered("sim:0")
        failing = [engine.submit(t) for t in ["a0", f"a1{POISON_MARKER}", "a2", "a3"]]
        fresh = [engine.submit(f"b{n}") for n in range(4)]
        gated.gate.set()
        await asyncio.gather(first, *fresh, *failing, return_exceptions=True)
    calls = [inputs for _, inputs in gated.calls]
    assert calls[1][0] == "a0"  # the failing batch
    assert calls[2] == ["b0", "b1", "b2", "b3"]  # the full fresh batch before its rescue
    rescued = {text for inputs in calls[3:] for text in inputs}  # then its parts, after it
    assert rescued == {"a0", f"a1{POISON_MARKER}", "a2", "a3"}


async def test_a_failed_batch_splits_into_one_part_per_free_device(gated):
    gated.gate.set()
    config = Config(max_batch_size=8)
    async with Engine(config, fn_per_device=gated, devices="sim:4", clock=FakeClock()) as engine:
        texts = [f"in-{n}" + (POISON_MARKER if n == 5 else "") for n in range(8)]
        tickets = [engine.submit(text) for text in texts]  # queued before any batch forms
        results = await asyncio.gather(*tickets, return_exceptions=True)
        sizes = sorted((len(inputs) for _, inputs in gated.calls), reverse=True)
        assert sizes == [8, 2, 2, 2, 2, 1, 1]  # 4 devices free: 4 parts, then the pair
        assert engine.recoveries["isolation_rounds"] == 3  # the poison input was in 3 calls
        assert [isinstance(r, BackendError) for r in results] == [n == 5 for n in range(8)]


async def test_a_repeated_poison_input_runs_apart_and_fails_only_itself(gated, caplog):
    poison = f"bad{POISON_MARKER}"
    async with Engine(Config(), fn_per_device=gated, devices="sim:1", clock=FakeClock()) as e:
        gated.gate.set()
        with pytest.raises(BackendError):
            await e.infer(poison)
        assert "is a poison input; a repeat of it will run apart" in caplog.text
        gated.gate.clear()
        first = e.submit("hold")
        await gated.entered("sim:0")
        tickets = [e.submit("c0"), e.submit(poison), e.submit("c1"), e.submit(poison)]
        gated.gate.set()
        results = await asyncio.gather(first, *tickets, return_exceptions=True)
        assert [type(r) for r in results[2::2]] == [BackendError, BackendError]
        assert [r.output for r in results if isinstance(r, Result)] == ["dloh", "0c", "1c"]
        assert e.recoveries["poison_repeats"] == 2
        assert e.recoveries["poison_isolated"] == 1
        # The first time; then both repeats in one call of their own, failed at once.
        assert e.faults["batch_raised"] == 2
    calls = [inputs for _, inputs in gated.calls[2:]]
    assert sorted(calls) == sorted([["c0", "c1"], [poison, poison]])


async def test_without_poison_memory_a_repeat_sinks_its_batch_again(gated):
    poison = f"bad{POISON_MARKER}"
    config = Config(poison_memory=0)
    async with Engine(config, fn_per_device=gated, devices="sim:1", clock=FakeClock()) as e:
        gated.gate.set()
        with pytest.raises(BackendError):
            await e.infer(poison)
        gated.gate.clear()
        first = e.submit("hold")
        await gated.entered("sim:0")
        tickets = [e.submit("c0"), e.submit(poison), e.submit("c1")]
        gated.gate.set()
        await asyncio.gather(first, *tickets, return_exceptions=True)
        assert e.faults["batch_raised"] > 2
    assert ["c0", poison, "c1"] in [inputs for _, inputs in gated.calls]


async def test_a_device_whose_every_call_raises_restarts_and_backs_off_while_broken(gated):
    """sim:1 fails every call on every input: it is marked failing after two calls, its
    requests run on sim:0, its factory is called again and its probe fails, so it stays
    out; once it works again, the next restart brings it back."""
    gated.gate.set()
    gated.broken = {"sim:1"}
    clock = FakeClock()
    config = Config(max_batch_size=4)
    async with Engine(config, fn_per_device=gated, devices="sim:2", clock=clock) as engine:
        for wave in range(10):
            texts = [f"w{wave}-{n}" for n in range(8)]
            results = await asyncio.gather(*map(engine.infer, texts))
            assert [r.output for r in results] == [simulate(t) for t in texts]
        # The restart loads and probes on sim:1's thread, while the waves run on sim:0.
        await polled(engine, lambda: engine.faults["restart_failed"] >= 1, "a failed restart")
        assert engine.device_states()["sim:1"] == "failing"
        assert gated.loads["sim:1"] >= 2  # loaded again on a fresh thread
        assert engine.faults["device_failing"] == 1
        assert engine.faults["restart_failed"] >= 1
        assert engine.recoveries["poison_isolated"] == 0  # no innocent input was blamed
        # Two batches failed in a row made it suspect; its probe failed, so it restarted.
        assert len(gated.calls_on("sim:1")) <= 4
        assert [PROBE_INPUT] in gated.calls_on("sim:1")
        gated.broken.clear()
        clock.advance(1.0)  # the first back-off
        await reach(engine, lambda s: s.healthy_devices == 2)
        assert engine.device_states()["sim:1"] == "idle"
        assert engine.faults["device_restarted"] == 1


async def test_a_malformed_result_is_retried_once_and_nobody_takes_from_it(start_server, gated):
    gated.gate.set()
    gated.malformed_calls = 1
    client, _ = await start_server(gated)
    status, body = await ask(client, "abc")
    assert (status, body["output"]) == (200, "cba")
    assert [inputs for _, inputs in gated.calls] == [["abc"], ["abc"]]


async def test_a_result_malformed_twice_gets_500_naming_the_fault(start_server, gated):
    gated.gate.set()
    gated.malformed_calls = 2
    client, engine = await start_server(gated)
    status, body = await ask(client, "abc")
    assert status == 500
    assert body["message"] == "the batch function returned 0 outputs for 1 inputs"
    assert len(gated.calls) == 2
    assert engine.faults["batch_malformed"] == 2


async def past_the_budget(
    client: TestClient, gated: GatedBackend, clock: FakeClock, text: str
) -> tuple[int, dict[str, object]]:
    """Asks for `text` and, once its call is inside sim:0, moves time past the budget."""
    answer = asyncio.ensure_future(ask(client, text))
    await gated.entered("sim:0")
    clock.advance(0.200)
    return await answer


async def test_a_hung_device_hands_its_batch_to_another_then_rejoins(start_server, gated):
    gated.gate.set()
    gated.stuck = {"sim:0"}
    clock = FakeClock()
    client, engine = await start_server(gated, devices=2, batch_timeout_ms=200, clock=clock)
    status, body = await past_the_budget(client, gated, clock, "abc")  # sim:0 is first
    assert (status, body["output"]) == (200, "cba")
    assert (gated.calls_on("sim:0"), gated.calls_on("sim:1")) == ([["abc"]], [["abc"]])
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["devices"] == {"sim:0": "hung", "sim:1": "idle"}
    answers = await asyncio.gather(*(ask(client, f"more-{n}") for n in range(50)))
    assert all(status == 200 for status, _ in answers)
    assert gated.calls_on("sim:0") == [["abc"]]  # no second call while the first is inside
    gated.unstick.set()
    await recovering(engine, "sim:0")
    clock.advance(0.200)  # one budget of back-off, then the probe
    await reach(engine, lambda s: s.healthy_devices == 2)
    assert gated.calls_on("sim:0") == [["abc"], [PROBE_INPUT]]
    assert set(gated.max_concurrent.values()) == {1}
    assert engine.faults["late_result_discarded"] == 1
    assert engine.device_states() == {"sim:0": "idle", "sim:1": "idle"}


async def test_with_no_healthy_device_left_requests_get_503_until_one_recovers(start_server, gated):
    gated.gate.set()
    gated.stuck = {"sim:0", "sim:1"}
    clock = FakeClock()
    client, engine = await start_server(gated, devices=2, batch_timeout_ms=200, clock=clock)
    answer = asyncio.ensure_future(ask(client, "abc"))
    await gated.entered("sim:0")
    clock.advance(0.200)  # hangs sim:0; its one retry goes to sim:1
    await gated.entered("sim:1")
    clock.advance(0.200)  # and hangs it too
    status, body = await answer
    assert status == 500
    assert "ran past its budget of 200 ms" in str(body["message"])
    ready = await client.get("/readyz")
    assert ready.status == 503
    assert (await ready.json())["status"] == "no healthy device"
    status, body = await ask(client, "new")
    assert (status, body["error"]) == (503, "NOT_READY")
    gated.stuck.clear()
    gated.unstick.set()
    for device in ("sim:0", "sim:1"):
        await recovering(engine, device)
    clock.advance(0.200)
    await reach(engine, lambda s: s.healthy_devices == 2)
    assert (await client.get("/readyz")).status == 200
    status, body = await ask(client, "new")
    assert (status, body["output"]) == (200, "wen")


async def test_when_the_last_device_hangs_its_batch_and_the_queue_are_answered_503(
    start_server, gated
):
    gated.gate.set()
    gated.stuck = {"sim:0"}
    clock = FakeClock()
    client, engine = await start_server(gated, batch_timeout_ms=200, clock=clock)
    running = asyncio.ensure_future(ask(client, "running"))
    await gated.entered("sim:0")
    queued = asyncio.ensure_future(ask(client, "queued"))
    await reach(engine, lambda s: s.queued == 1)
    clock.advance(0.200)
    for status, body in [await running, await queued]:
        assert (status, body["error"]) == (503, "NOT_READY")
        assert body["message"] == "no healthy device is left to run this request"
    assert gated.calls == [("sim:0", ["running"])]
    assert engine.stats().pending == 0


async def test_a_hung_device_never_holds_a_request_past_its_deadline(start_server, gated):
    gated.gate.set()
    gated.stuck = {"sim:0"}
    clock = FakeClock()
    client, engine = await start_server(gated, batch_timeout_ms=60_000, clock=clock)
    answer = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "x", "timeout_ms": 50})
    )
    await gated.entered("sim:0")
    clock.advance(0.050)
    response = await answer
    assert response.status == 504
    assert engine.stats().pending == 0
    assert engine.stats().in_flight == 0  # the drain at teardown need not wait


async def test_a_device_that_fails_to_load_is_left_out(start_server):
    backend = GatedBackend()
    backend.gate.set()

    def factory(device: str):
        if device == "sim:1":
            raise RuntimeError("CUDA error: out of memory")
        return backend(device)

    client, engine = await start_server(factory, devices=3)
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["devices"] == {"sim:0": "idle", "sim:1": "dead", "sim:2": "idle"}
    answers = await asyncio.gather(*(ask(client, f"x{n}") for n in range(100)))
    assert all(status == 200 for status, _ in answers)
    assert {device for device, _ in backend.calls} <= {"sim:0", "sim:2"}
    assert engine.stats().healthy_devices == 2


def stepped_call(
    inputs: list[str], permit: threading.Semaphore, record: Callable[[list[str]], object]
) -> list[str]:
    """A call that records its inputs and waits for `permit` (the warm-up passes freely),
    then raises if it holds a poison input, else answers as the simulated model does."""
    if inputs != [WARM_UP_INPUT]:
        record(list(inputs))
        permit.acquire()
    if any(POISON_MARKER in text for text in inputs):
        raise ValueError("this batch holds a poison input")
    return [simulate(text) for text in inputs]


class SteppedDevice:
    """A one-device backend whose calls each wait for a permit: the test lets them finish one
    at a time, and sees each call's inputs."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.calls: list[list[str]] = []

    def __call__(self, device: str) -> Callable[[list[str]], list[str]]:
        return lambda inputs: stepped_call(inputs, self.permits, self.calls.append)


async def to_the_end(
    engine: Engine, clock: FakeClock, tickets: list[asyncio.Future[Result]]
) -> list[Result | BaseException]:
    """Every ticket's outcome, moving virtual time on while no call runs (the policy may
    be waiting for a fuller batch), and never during a call."""
    everything = asyncio.gather(*tickets, return_exceptions=True)
    async with asyncio.timeout(HANG_GUARD_S):
        while not everything.done():
            if not engine.stats().in_flight:
                clock.advance(0.010)
            await asyncio.sleep(0)
    return await everything


async def warm(engine: Engine, clock: FakeClock, stepped: SteppedDevice) -> None:
    """Three fresh batches that succeed: rescue rides only while few fresh batches fail."""
    stepped.permits.release(3)
    for n in range(3):
        await to_the_end(engine, clock, [engine.submit(f"warm-{n}")])
    stepped.calls.clear()


async def pair_then_fresh(
    engine: Engine,
    clock: FakeClock,
    stepped: SteppedDevice,
    pair: tuple[str, str] = ("s0", f"p{POISON_MARKER}"),
    fresh: tuple[str, str] = ("f0", f"g{POISON_MARKER}"),
) -> list[Result | BaseException]:
    """[s0, p] fails while [f0, g] (g poison too) waits; then everything runs to the end."""
    held = engine.submit("held")
    await reach(engine, lambda s: s.in_flight == 1)
    first = [engine.submit(t) for t in pair]
    await reach(engine, lambda s: s.queued == 2)
    stepped.permits.release()  # "held" answers; [s0, p] starts
    await reach(engine, lambda s: s.in_flight == 2)
    then = [engine.submit(t) for t in fresh]
    await reach(engine, lambda s: s.queued == 2)
    stepped.permits.release(100)
    return await to_the_end(engine, clock, [held, *first, *then])


FAILING = [f"a{n}" + (POISON_MARKER if n == 1 else "") for n in range(20)]
"""A full batch (of 20) with one poison input."""


async def full_batch_fails_while_fresh_wait(stepped: SteppedDevice, fresh: list[str]) -> Engine:
    """On one device with batches of 20, FAILING runs while `fresh` arrive, and fails; then
    everything runs to the end, and each request gets its own answer (500 for the poison)."""
    clock = FakeClock()
    config = Config(max_batch_size=20)
    async with Engine(config, fn_per_device=stepped, devices="sim:1", clock=clock) as engine:
        await warm(engine, clock, stepped)
        held = engine.submit("held")
        await reach(engine, lambda s: s.in_flight == 1)
        tickets = [engine.submit(t) for t in FAILING]
        await reach(engine, lambda s: s.queued == len(FAILING))
        stepped.permits.release()  # "held" answers; the full batch of 20 starts
        await reach(engine, lambda s: s.in_flight == len(FAILING))
        tickets += [engine.submit(t) for t in fresh]
        await reach(engine, lambda s: s.queued == len(fresh))
        stepped.permits.release(100)  # the batch of 20 fails; everything else may run
        results = await to_the_end(engine, clock, [held, *tickets])
    for text, result in zip(["held", *FAILING, *fresh], results, strict=True):
        if POISON_MARKER in text:
            assert isinstance(result, BackendError)
        else:
            assert isinstance(result, Result)
            assert result.output == simulate(text)
    return engine


async def test_a_lone_rider_is_not_poison_until_it_fails_alone(gated):
    """A single input rides in a fresh batch that holds a poison input of its own: the
    ride fails, but the rider has not failed alone, so it runs alone and is answered."""
    stepped = SteppedDevice()
    clock = FakeClock()
    async with Engine(Config(), fn_per_device=stepped, devices="sim:1", clock=clock) as engine:
        await warm(engine, clock, stepped)
        results = await pair_then_fresh(engine, clock, stepped)
    assert stepped.calls[2] == ["f0", f"g{POISON_MARKER}", "s0"]  # s0 rode, and sank
    assert ["s0"] in stepped.calls[3:]  # then ran alone
    outcomes = [r.output if isinstance(r, Result) else type(r) for r in results]
    assert outcomes == ["dleh", "0s", BackendError, "0f", BackendError]
    assert engine.recoveries["poison_isolated"] == 2


async def test_rescue_does_not_ride_while_many_fresh_batches_fail(gated):
    """Under a flood of poison most fresh batches fail: a ride would sink more fresh
    requests than it answers, so the failed batch's parts run on their own."""
    stepped = SteppedDevice()
    clock = FakeClock()
    async with Engine(Config(), fn_per_device=stepped, devices="sim:1", clock=clock) as engine:
        results = await pair_then_fresh(engine, clock, stepped)  # 1 of 2 fresh batches fails
    assert not any("f0" in inputs and "s0" in inputs for inputs in stepped.calls)
    assert engine.recoveries["rides"] == 0
    assert [isinstance(r, Result) for r in results] == [True, True, False, True, False]


async def test_rides_stop_while_most_of_them_sink_and_are_tried_again_later(gated):
    """A ride saves its group a call and a sunk one costs its fresh requests one: while
    most rides sink (rescue groups carry the poison that failed their batch), groups run on
    their own; once the sunk rides are a while back, a group rides again."""
    stepped = SteppedDevice()
    clock = FakeClock()
    async with Engine(Config(), fn_per_device=stepped, devices="sim:1", clock=clock) as engine:
        for _ in range(8):
            await warm(engine, clock, stepped)  # enough fresh batches that few fail
        await pair_then_fresh(engine, clock, stepped)
        assert ["f0", f"g{POISON_MARKER}", "s0"] in stepped.calls  # s0 rode, and sank
        await pair_then_fresh(engine, clock, stepped, ("s1", f"q{POISON_MARKER}"), ("f1", "f2"))
        assert not any("s1" in inputs and "f1" in inputs for inputs in stepped.calls)
        clock.advance(2.0)  # the sunk ride decays in the record, below RIDE_PROBE_RATE
        await pair_then_fresh(engine, clock, stepped, ("s2", f"r{POISON_MARKER}"), ("f3", "f4"))
        assert ["f3", "f4", "s2"] in stepped.calls  # s2 rode again
    assert engine.recoveries["rides"] == 2


async def test_a_rescue_group_rides_in_a_fresh_batchs_room_and_sinks_only_it(gated):
    """While fresh requests flow, a failed batch's parts (about its square root in size)
    ride in the room of fresh batches (a flat-cost call costs the same however full)
    instead of taking calls of their own. A ride that fails puts its fresh requests first,
    whole; only its riders split again."""
    stepped = SteppedDevice()
    engine = await full_batch_fails_while_fresh_wait(stepped, ["b0", "b1"])
    assert stepped.calls[2] == ["b0", "b1", *FAILING[:5]]  # the part holding the poison
    assert stepped.calls[3] == ["b0", "b1"]  # its fresh requests again, first and whole
    assert [len(inputs) for inputs in stepped.calls[4:]].count(5) == 3  # the clean parts
    assert [FAILING[1]] in stepped.calls[4:]  # its riders split again, down to the poison
    assert engine.recoveries["rides_failed"] == 1


async def test_a_full_fresh_batch_keeps_room_for_a_rescue_group(gated):
    """Failed calls leave a backlog of fresh requests behind them, and a batch filled from
    a backlog has no room: a full fresh batch still carries one part of a split, so that
    rescue (whose requests are older than any fresh one) does not wait until the load ends."""
    stepped = SteppedDevice()
    fresh = [f"b{n}" for n in range(40)]  # two full batches of backlog
    await full_batch_fails_while_fresh_wait(stepped, fresh)
    # Room for a part of 5 (20 split in 4): 15 fresh requests and the part holding the poison.
    assert stepped.calls[2] == [*fresh[:15], *FAILING[:5]]
    assert stepped.calls[3] == fresh[:15]  # the ride sank: its fresh requests again, whole
    assert all(len(inputs) <= 20 for inputs in stepped.calls)


class PerDeviceSteps:
    """Devices whose calls each wait for a permit of their own device; it records which
    device ran which inputs."""

    def __init__(self, devices: list[str]) -> None:
        self.permits = {device: threading.Semaphore(0) for device in devices}
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, device: str) -> Callable[[list[str]], list[str]]:
        def record(inputs: list[str]) -> None:
            self.calls.append((device, inputs))

        return lambda inputs: stepped_call(inputs, self.permits[device], record)


async def until(engine: Engine, clock: FakeClock, done: Callable[[], bool]) -> None:
    """Virtual time on in steps of 5 ms (a policy may linger) until `done()`, at most 500 ms
    of it: never as far as a call's 1 s watchdog. Past that, it only yields to the loop: a
    device's thread on a loaded machine may still be finishing the call that makes `done()`
    true (bounded by the hang guard)."""
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            for turn in itertools.count(1):
                if done():
                    return
                await asyncio.sleep(0)
                if turn % 20 == 0 and turn <= 2_000:  # 100 steps, 20 loop turns apart
                    clock.advance(0.005)
    except TimeoutError:
        pass
    pytest.fail(f"never got there; the engine is {engine.stats()}")


async def test_a_rescue_group_does_not_ride_back_to_the_device_it_just_failed_on(gated):
    """A full batch fails on sim:0 while sim:1 is busy; fresh requests then find only sim:0
    free. The failed batch's parts do not ride with them (sim:0 may be the broken one, and
    would sink them all again): they wait for sim:1, and every request gets its answer."""
    steps = PerDeviceSteps(["sim:0", "sim:1"])
    clock = FakeClock()
    # A hang budget the test's virtual time never reaches: each `until` may advance up to
    # 500 ms while a thread is slow to return, and "busy" spans several of them.
    config = Config(max_batch_size=20, batch_timeout_ms=600_000)
    async with Engine(config, fn_per_device=steps, devices="sim:2", clock=clock) as engine:
        for n in range(3):  # three fresh batches that succeed: rides pay
            steps.permits["sim:0"].release()
            warm = engine.submit(f"warm-{n}")
            await until(engine, clock, warm.done)
        steps.calls.clear()
        failing = [engine.submit(text) for text in FAILING]  # full: starts on sim:0 at once
        await reach(engine, lambda s: s.in_flight == len(FAILING))
        busy = engine.submit("busy")
        await until(engine, clock, lambda: len(steps.calls) == 2)  # "busy" holds sim:1
        steps.permits["sim:0"].release()  # the batch of 20 fails on sim:0
        await until(engine, clock, lambda: engine.stats().in_flight == 1)
        fresh = [engine.submit(f"b{n}") for n in range(2)]
        try:
            await until(engine, clock, lambda: len(steps.calls) == 3)
        finally:  # whatever ran, everything may now finish (a failed check must not hang)
            steps.permits["sim:0"].release(100)
            steps.permits["sim:1"].release(100)
        everything = [*failing, busy, *fresh]
        await until(engine, clock, lambda: all(ticket.done() for ticket in everything))
    assert steps.calls[2] == ("sim:0", ["b0", "b1"])  # alone: nothing of FAILING rode
    rescues = [(device, inputs) for device, inputs in steps.calls[3:] if FAILING[0] in inputs]
    assert rescues[0][0] == "sim:1"  # the first rescue call went to the other device
    for text, ticket in zip(FAILING, failing, strict=True):
        outcome = ticket.outcome()
        if POISON_MARKER in text:
            assert isinstance(outcome, BackendError)
        else:
            assert isinstance(outcome, Result)
            assert outcome.output == simulate(text)
    others = [ticket.outcome() for ticket in [busy, *fresh]]
    assert [o.output if isinstance(o, Result) else o for o in others] == ["ysub", "0b", "1b"]


def naming(gated: GatedBackend) -> Callable[[str], Callable[[list[str]], list[str]]]:
    """`gated`, with a batch function whose error names every input of its call: the worst
    case for what an error answer may carry."""

    def load(device: str) -> Callable[[list[str]], list[str]]:
        run = gated(device)

        def named(inputs: list[str]) -> list[str]:
            try:
                return run(inputs)
            except ValueError:
                raise ValueError(f"cannot run {inputs}") from None

        return named

    return load


async def test_an_error_answer_carries_the_batch_functions_message_only_to_a_lone_request(
    gated,
):
    gated.gate.set()
    config = Config(bisect_failures=False)
    async with Engine(
        config, fn_per_device=naming(gated), devices="sim:1", clock=FakeClock()
    ) as engine:
        shared = [engine.submit(text) for text in ("mine", f"theirs{POISON_MARKER}")]
        outcomes = await asyncio.gather(*shared, return_exceptions=True)
        alone = await asyncio.gather(engine.infer(f"alone{POISON_MARKER}"), return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, BackendError)
        assert "mine" not in str(outcome)
        assert "theirs" not in str(outcome)
        assert "raised ValueError on a batch this request shared with others" in str(outcome)
    [lone] = alone
    assert isinstance(lone, BackendError)
    assert str(lone) == f"the batch function raised ValueError: cannot run ['alone{POISON_MARKER}']"


async def test_one_tenants_poison_fails_no_other_request_and_no_answer_names_another(gated):
    """An attacker mixes poison into its requests while a victim sends plain ones, all at
    once, faster than the measured capacity and with no retry budget (so the old rule
    predicted no spare time and failed the rescue with the batch function's message):
    every request that is not poison, the victim's and the attacker's own, is answered
    with its own output, and no error names another request's input."""
    config = Config(retry_budget=0, retry_reserve=0, max_batch_size=5)
    clock = FakeClock()
    victim, attacker = Tenant("victim", "paid"), Tenant("attacker", "paid")
    async with Engine(config, fn_per_device=naming(gated), devices="sim:2", clock=clock) as engine:
        first = engine.submit("measure the call time")
        await gated.entered("sim:0")
        clock.advance(0.1)  # the call takes 100 ms: 2 devices x 5 / 0.1 s = 100 rps
        gated.gate.set()
        await first
        sent = [
            (f"v{n}", victim) if n % 5 < 3 else (f"a{n}" + (POISON_MARKER * (n % 5 == 4)), attacker)
            for n in range(250)  # arriving faster than the 100 rps measured below
        ]
        tickets = [engine.submit(text, Caller(tenant=tenant)) for text, tenant in sent]
        outcomes = await asyncio.gather(*tickets, return_exceptions=True)
    texts = [text for text, _ in sent]
    for (text, _), outcome in zip(sent, outcomes, strict=True):
        if POISON_MARKER in text:
            assert isinstance(outcome, BackendError), text
            others = [t for t in texts if t != text and f"'{t}'" in str(outcome)]
            assert not others, (text, str(outcome))
        else:
            assert isinstance(outcome, Result), (text, outcome)
            assert outcome.output == simulate(text)
    assert engine.recoveries["failed"] == 50
