"""The engine on its own: no HTTP, virtual time (a FakeClock the test moves), gated devices.

Deadlines, linger and spacing, the watchdog, probes, rate limits, drain and task
supervision are each checked at exact virtual instants: nothing here sleeps or depends on
how fast the machine is.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from batchserve import Ask, Config, Engine
from batchserve.batching.request import IDS_PER_DRAW, new_request_id
from batchserve.clock import FakeClock
from batchserve.engine.requests import Caller
from batchserve.errors import DeadlineExceeded, NotReady, RateLimited
from batchserve.models.backends import simulate
from batchserve.observability.window import WINDOW_S
from batchserve.rules.policy import Decision, QueueView
from batchserve.rules.tenants import Tenant

from .conftest import GatedBackend, reach, recovering

ROOT = Path(__file__).resolve().parent.parent


@asynccontextmanager
async def running(
    gated: GatedBackend, clock: FakeClock, devices: int = 1, **settings: object
) -> AsyncIterator[Engine]:
    config = Config(**settings)  # type: ignore[arg-type]
    async with Engine(config, fn_per_device=gated, devices=f"sim:{devices}", clock=clock) as e:
        yield e


async def test_the_readme_example_runs():
    namespace: dict[str, object] = {}
    exec(compile((ROOT / "examples" / "embedded.py").read_text(), "embedded.py", "exec"), namespace)
    outputs = await namespace["main"]()  # type: ignore[operator]
    assert outputs == [f"ITEM {n}" for n in range(100)]


async def test_the_readme_web_app_example_answers_each_request_its_own(aiohttp_client):
    namespace: dict[str, object] = {"__name__": "webapp"}
    exec(compile((ROOT / "examples" / "webapp.py").read_text(), "webapp.py", "exec"), namespace)
    client = await aiohttp_client(namespace["make_app"]())  # type: ignore[operator]
    answers = await asyncio.gather(
        *(client.get("/shout", params={"text": f"item {n}"}) for n in range(50))
    )
    assert [(await a.json())["shouted"] for a in answers] == [f"ITEM {n}" for n in range(50)]


async def test_concurrent_calls_are_batched_and_each_gets_its_own_output(gated):
    gated.gate.set()
    async with running(gated, FakeClock(), devices=3) as engine:
        texts = [f"in-{n}" for n in range(1000)]
        results = await asyncio.gather(*(engine.infer(text) for text in texts))
        assert [result.output for result in results] == [simulate(text) for text in texts]
        assert max(result.batch_size for result in results) > 1
        assert engine.stats().pending == 0
    assert set(gated.max_concurrent.values()) == {1}


async def test_admit_and_settle_run_a_request_as_infer_does(gated):
    gated.gate.set()
    async with running(gated, FakeClock(), timeout_ms=50) as engine:
        request, expiry = engine.admit("inference", Ask("mine"), "id-1", None, None)
        assert engine.stats().pending == 1
        result = await request.future
        engine.settle("inference", request, expiry, None, result)
        assert (result.output, engine.stats().pending) == (simulate("mine"), 0)
        left, expiry = engine.admit("inference", Ask("left"), "id-2", None, None)
        engine.settle("inference", left, expiry, None, None)  # its waiter left unanswered
        assert engine.stats().pending == 0
        assert (await engine.infer("again", Caller(request_id="id-2"))).output == simulate("again")
        assert engine.metrics is not None
        assert engine.metrics.snapshot()["throughput_rps"] == 2 / WINDOW_S  # not "left"


async def test_a_deadline_passes_at_its_exact_virtual_time_and_never_reaches_a_device(gated):
    clock = FakeClock()
    async with running(gated, clock, timeout_ms=30) as engine:
        held = asyncio.ensure_future(engine.infer("held"))
        await reach(engine, lambda s: s.in_flight == 1)
        late = asyncio.ensure_future(engine.infer(Ask("late", timeout_ms=20)))
        capped = asyncio.ensure_future(engine.infer(Ask("capped", timeout_ms=60_000)))
        await reach(engine, lambda s: s.queued == 2)
        clock.advance(0.0199)
        await asyncio.sleep(0)
        assert not late.done()
        clock.advance(0.0001)
        with pytest.raises(DeadlineExceeded):
            await late
        assert not capped.done()
        clock.advance(0.010)  # the server's 30 ms cap, though it asked for a minute
        for task in (capped, held):  # held: answered at its deadline, still on the device
            with pytest.raises(DeadlineExceeded):
                await task
        gated.gate.set()
        await reach(engine, lambda s: s.free_devices == 1)  # the held call has returned
    assert gated.seen_inputs() == ["held"]


async def test_a_partial_batch_waits_out_the_spacing_then_leaves(gated):
    """Two devices, a measured batch time of 100 ms: a partial batch leaves no sooner than
    0.9 x 100 / 2 = 45 ms after the last start, to keep the devices staggered."""
    clock = FakeClock()
    async with running(gated, clock, devices=2) as engine:
        first = asyncio.ensure_future(engine.infer("measure"))
        await reach(engine, lambda s: s.in_flight == 1)
        clock.advance(0.100)
        gated.gate.set()
        await first
        assert engine.view.call_time_s == pytest.approx(0.100)
        gated.gate.clear()
        started = clock.time()
        running_one = asyncio.ensure_future(engine.infer("a"))
        await reach(engine, lambda s: s.in_flight == 1)
        held = asyncio.ensure_future(engine.infer("b"))
        await reach(engine, lambda s: s.queued == 1)
        clock.advance(0.0449)
        await asyncio.sleep(0)
        assert engine.stats().queued == 1  # still held, though sim:1 is free
        clock.advance(started + 0.045 - clock.time())
        await reach(engine, lambda s: s.in_flight == 2)
        gated.gate.set()
        assert [(await task).output for task in (running_one, held)] == ["a", "b"]


async def test_a_hung_call_moves_to_the_other_device_and_a_probe_brings_it_back(gated):
    gated.gate.set()
    gated.stuck = {"sim:0"}
    clock = FakeClock()
    async with running(gated, clock, devices=2, batch_timeout_ms=200) as engine:
        answer = asyncio.ensure_future(engine.infer("abc"))
        await reach(engine, lambda s: s.in_flight == 1)
        clock.advance(0.200)
        assert (await answer).device == "sim:1"
        assert engine.device_states() == {"sim:0": "hung", "sim:1": "idle"}
        gated.unstick.set()
        await recovering(engine, "sim:0")
        clock.advance(0.200)  # one budget of back-off, then the probe
        await reach(engine, lambda s: s.healthy_devices == 2)
        assert engine.faults["late_result_discarded"] == 1


async def test_a_tenant_bucket_refills_on_the_engine_clock(gated, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys."k"]\ntenant = "t"\ntier = "free"\n[tiers.free]\nrate = 1\nburst = 1\n')
    gated.gate.set()
    clock = FakeClock()
    tenant = Tenant("t", "free")
    async with running(gated, clock, keys_file=str(keys)) as engine:
        assert engine.authenticate("Bearer k") == tenant
        assert (await engine.infer("x", Caller(tenant=tenant))).output == "x"
        with pytest.raises(RateLimited) as limited:
            await engine.infer("y", Caller(tenant=tenant))
        assert limited.value.retry_after_s == pytest.approx(1.0)
        clock.advance(1.0)
        assert (await engine.infer("z", Caller(tenant=tenant))).output == "z"


async def test_a_ticket_goes_queued_running_completed(gated):
    async with running(gated, FakeClock()) as engine:
        first = engine.submit("first")
        await reach(engine, lambda s: s.in_flight == 1)
        second = engine.submit("second")
        assert (first.status, second.status) == ("running", "queued")
        gated.gate.set()
        assert (await second).output == "dnoces"
        assert (first.status, second.status) == ("completed", "completed")


async def test_a_waiter_on_the_state_sees_the_request_whose_arrival_changed_it(gated):
    """The batcher announces a change once it holds the request: by then the request is
    counted as pending, or a waiter for it would see the old count and sleep on."""
    async with running(gated, FakeClock()) as engine:
        first = engine.submit("first")
        await reach(engine, lambda s: s.in_flight == 1)
        waiter = asyncio.ensure_future(engine.view.wait_until(lambda s: s.pending == 2))
        await asyncio.sleep(0)  # it waits: one pending
        assert not waiter.done()
        second = engine.submit("second")  # queued behind the gate: only it changes the state
        await asyncio.sleep(0)  # the woken waiter's turn
        seen = waiter.done()
        waiter.cancel()
        gated.gate.set()
        await asyncio.gather(first, second)
    assert seen


async def test_a_drain_that_does_not_refuse_serves_what_still_arrives(gated):
    """drain(refuse_new=False), a server's whose doors are already closed: readiness is
    off, and a request its open connections still bring is run and answered; the drain
    waits for it."""
    async with running(gated, FakeClock()) as engine:
        held = asyncio.ensure_future(engine.infer("held"))
        await reach(engine, lambda s: s.in_flight == 1)
        draining = asyncio.ensure_future(engine.drain(refuse_new=False))
        await asyncio.sleep(0)
        assert engine.readiness() == (False, "draining")
        late = asyncio.ensure_future(engine.infer("late"))
        await reach(engine, lambda s: s.queued == 1)
        assert not draining.done()
        gated.gate.set()
        assert [(await held).output, (await late).output] == ["dleh", "etal"]
        await draining
        assert engine.stats().pending == 0


async def test_drain_runs_out_in_virtual_time_and_a_blocked_device_thread_is_left_behind(gated):
    """The gate stays closed through teardown: the engine still exits, answering 503, and
    never waits for the wedged thread (the fixture opens the gate after the test)."""
    clock = FakeClock()
    async with running(gated, clock, drain_timeout_s=1) as engine:
        stuck = asyncio.ensure_future(engine.infer("stuck"))
        await reach(engine, lambda s: s.in_flight == 1)
        draining = asyncio.ensure_future(engine.drain())
        await asyncio.sleep(0)
        assert engine.readiness() == (False, "draining")
        with pytest.raises(NotReady, match="draining"):
            await engine.infer("new")
        clock.advance(0.999)
        await asyncio.sleep(0)
        assert not stuck.done()
        clock.advance(0.001)
        await draining
        with pytest.raises(NotReady, match="shut down before this request could run"):
            await stuck
    assert not gated.gate.is_set()
    assert any(t.name == "batchserve-sim:0" and t.is_alive() for t in threading.enumerate())


class BrokenPolicy:
    """Raises once a request is queued: a bug in the batching loop."""

    def decide(
        self, now: float, queue: QueueView, free_devices: int, busy_since: Sequence[float]
    ) -> Decision:
        if queue.size:
            raise ZeroDivisionError("a bug in the policy")
        return Decision(0)


async def test_a_crashed_batcher_fails_what_it_holds_and_turns_the_engine_not_ready(gated, caplog):
    config = Config()
    engine = Engine(config, fn_per_device=gated, devices="sim:1", clock=FakeClock(),
                    policy=BrokenPolicy())  # fmt: skip
    async with engine:
        with pytest.raises(NotReady, match="batchserve-batcher crashed: ZeroDivisionError"):
            await engine.infer("x")
        assert engine.failed.is_set()
        assert engine.readiness() == (False, "failed")
        with pytest.raises(NotReady, match="failed"):
            await engine.infer("y")
    assert "batchserve-batcher crashed" in caplog.text


def test_request_ids_are_unique_hex_and_a_forked_child_draws_its_own():
    ids = [new_request_id() for _ in range(3 * IDS_PER_DRAW + 1)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        os.write(write_end, new_request_id().encode())
        os._exit(0)
    os.waitpid(child, 0)
    childs_id = os.read(read_end, 64).decode()
    os.close(read_end)
    os.close(write_end)
    assert len(childs_id) == 32
    assert childs_id not in ids
    assert childs_id != new_request_id()  # the parent's next: the block was not shared
