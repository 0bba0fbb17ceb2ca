"""The Batch API's tier, in the engine alone: virtual time, a gated device. A batch line
waits below every online request, never rides in an online batch (nor does its rescue),
and keeps no online request waiting longer than the one batch call on the device; a line
whose deadline cannot be met ends in the error file rather than waiting out its batch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
import pytest

from batchserve import Caller, Config, Engine
from batchserve.batching.request import Ask, Result
from batchserve.clock import FakeClock
from batchserve.config import POISON_MARKER
from batchserve.doors.batch_lines import Late, LineEngine, LineRunner
from batchserve.doors.batch_runner import LATE_TRIES, RETRY_S
from batchserve.errors import BackendError, DeadlineExceeded, DeadlineTooShort, PrefillTooLong
from batchserve.models.backends import simulate
from batchserve.models.specs import ModelSpec
from batchserve.rules.tenants import Tenant
from batchserve.server import create_app

from .conftest import HANG_GUARD_S, BatchserveTestServer, GatedBackend, reach, until
from .test_batch_api import IDLE, create, ended, jsonl, line, lines_of, upload

LINE = Caller(tenant=IDLE)
"""A Batch API line's caller: the idle tier."""


@asynccontextmanager
async def running(gated: GatedBackend, **settings: object) -> AsyncIterator[Engine]:
    config = Config(**settings)  # type: ignore[arg-type]
    async with Engine(config, fn_per_device=gated, devices="sim:1", clock=FakeClock()) as e:
        yield e


def calls(gated: GatedBackend) -> list[list[str]]:
    return [inputs for _, inputs in gated.calls]


async def test_online_requests_go_before_waiting_lines_and_never_share_their_calls(gated):
    async with running(gated) as engine:
        first = asyncio.ensure_future(engine.infer("online-0"))
        await reach(engine, lambda s: s.in_flight == 1)
        lines = [asyncio.ensure_future(engine.infer(f"line-{n}", LINE)) for n in range(3)]
        online = [asyncio.ensure_future(engine.infer(f"online-{n}")) for n in (1, 2)]
        await reach(engine, lambda s: s.queued == 2)
        gated.gate.set()
        await asyncio.gather(first, *online, *lines)
    assert calls(gated) == [["online-0"], ["online-1", "online-2"], ["line-0", "line-1", "line-2"]]


async def test_an_online_request_waits_for_at_most_the_one_batch_call_in_hand(gated):
    async with running(gated) as engine:
        lines = [asyncio.ensure_future(engine.infer(f"line-{n}", LINE)) for n in range(2)]
        await reach(engine, lambda s: s.in_flight == 2)  # an idle device takes them at once
        more = [asyncio.ensure_future(engine.infer(f"later-{n}", LINE)) for n in range(2)]
        online = asyncio.ensure_future(engine.infer("online"))
        await reach(engine, lambda s: s.queued == 1)
        gated.gate.set()
        await asyncio.gather(online, *lines, *more)
    assert calls(gated) == [["line-0", "line-1"], ["online"], ["later-0", "later-1"]]


async def test_waiting_lines_take_none_of_the_online_queue_bound(gated):
    async with running(gated, max_queue=1) as engine:
        first = asyncio.ensure_future(engine.infer("online-0"))
        await reach(engine, lambda s: s.in_flight == 1)
        lines = [asyncio.ensure_future(engine.infer(f"line-{n}", LINE)) for n in range(5)]
        online = asyncio.ensure_future(engine.infer("online-1"))  # the one place is free
        await reach(engine, lambda s: s.queued == 1)
        assert engine.stats().queued == 1
        gated.gate.set()
        await asyncio.gather(first, online, *lines)
        assert engine.metrics is not None
        counts = engine.metrics.snapshot()["batch_api"]
    assert (counts["waiting"], counts["running"], counts["done"]) == (0, 0, 5)


@pytest.mark.parametrize("warm", [0, 4], ids=["retry-first", "retry-rides"])
async def test_a_failed_line_call_runs_again_in_idle_time_never_ahead_of_or_beside_online(
    gated, warm
):
    # Planned as online work's, the lines' rescue would be paid and go before the online
    # request; or, once a few online calls have succeeded (rides pay), split to ride in its
    # batch, the same tenant's. Either way it must wait for idle time.
    owner = Caller(tenant=Tenant(IDLE.name, "free"))
    async with running(gated) as engine:
        gated.gate.set()
        for n in range(warm):
            await engine.infer(f"warm-{n}", owner)
        gated.gate.clear()
        texts = ["line-0", f"line-1{POISON_MARKER}", "line-2"]
        lines = [asyncio.ensure_future(engine.infer(text, LINE)) for text in texts]
        await reach(engine, lambda s: s.in_flight == 3)
        online = asyncio.ensure_future(engine.infer("online", owner))
        await reach(engine, lambda s: s.queued == 1)
        gated.gate.set()
        assert (await online).output == simulate("online")
        outcomes = await asyncio.gather(*lines, return_exceptions=True)
    assert calls(gated)[warm : warm + 2] == [texts, ["online"]]
    assert not any("online" in inputs and len(inputs) > 1 for inputs in calls(gated))
    assert isinstance(outcomes[1], BackendError)
    assert [outcomes[0].output, outcomes[2].output] == [simulate(t) for t in texts[::2]]  # type: ignore[union-attr]


async def test_a_line_whose_deadline_is_shorter_than_one_call_is_refused_at_once(gated):
    # Waiting in the idle tier, it would only expire, be tried again and expire again.
    clock = FakeClock()
    async with Engine(Config(), fn_per_device=gated, devices="sim:1", clock=clock) as engine:
        first = asyncio.ensure_future(engine.infer("online"))
        await gated.entered("sim:0")
        clock.advance(0.1)  # a call takes 100 ms here
        gated.gate.set()
        await first
        with pytest.raises(DeadlineTooShort, match="shorter than one batch call"):
            await engine.infer(Ask("line", timeout_ms=10), LINE)
        assert (await engine.infer(Ask("line", timeout_ms=200), LINE)).output == simulate("line")


async def test_a_line_late_try_after_try_goes_to_the_error_file_with_its_504(
    aiohttp_client, gated, tmp_path, monkeypatch
):
    # Its deadline passes each time while online work holds the devices: after LATE_TRIES
    # it is recorded as online would answer it, instead of holding its batch for 24 hours.
    clock = FakeClock()
    engine = Engine(
        Config(batch_db=str(tmp_path / "b.db")), fn_per_device=gated, devices="sim:1", clock=clock
    )
    tried = asyncio.Event()

    async def late(ask: Ask, caller: Caller) -> Result:
        tried.set()
        raise DeadlineExceeded("the request's deadline passed")

    monkeypatch.setattr(engine, "infer", late)
    client = await aiohttp_client(BatchserveTestServer(create_app(engine)))
    _, file = await upload(client, jsonl(line(0, input="x", timeout_ms=50)))
    _, batch = await create(client, file["id"])
    for _ in range(LATE_TRIES):
        async with asyncio.timeout(HANG_GUARD_S):
            await tried.wait()
        tried.clear()
        clock.advance(RETRY_S)  # the runner's wait before it offers the line again
    batch = await ended(client, batch["id"])
    assert (batch["status"], batch["request_counts"]["failed"]) == ("completed", 1)
    (error,) = await lines_of(client, batch["error_file_id"])
    assert error["custom_id"] == "r0"
    assert error["response"]["status_code"] == 504
    assert error["response"]["body"]["error"]["code"] == "DEADLINE_EXCEEDED"


@pytest.mark.parametrize(
    ("error", "late"),
    [
        (DeadlineExceeded("the request's deadline passed"), True),
        (DeadlineTooShort("shorter than one batch call"), False),
        (PrefillTooLong("the prompt alone prefills past its deadline"), False),
    ],
)
async def test_only_a_deadline_that_passed_as_the_line_waited_is_tried_again(error, late):
    async def refused(*args: object, **asks: object) -> Result:
        raise error

    engine = LineEngine(refused, refused, refused, refused, refused, refused, refused)  # type: ignore[arg-type]
    raw = orjson.dumps(line(0, input="x", timeout_ms=50))
    outcome = await LineRunner(engine).run(raw, "/api/inference", IDLE)
    assert isinstance(outcome, Late) is late
    recorded = outcome.outcome if isinstance(outcome, Late) else outcome
    assert recorded is not None
    assert recorded.failed
    assert orjson.loads(recorded.line)["response"]["body"]["error"]["code"] == error.code


@asynccontextmanager
async def lingering_beside_a_line(
    gated: GatedBackend, **settings: object
) -> AsyncIterator[tuple[Engine, FakeClock, asyncio.Future[Result], asyncio.Future[Result]]]:
    """One free device and a fixed policy lingering 50 ms of virtual time: an online request
    waits on it, and a Batch API line waits below it (lines never run while online waits)."""
    async with running(
        gated, policy="fixed", max_linger_ms=50, max_batch_size=8, **settings
    ) as engine:
        clock = engine.clock
        assert isinstance(clock, FakeClock)
        gated.gate.set()
        online = asyncio.ensure_future(engine.infer("online"))
        line = asyncio.ensure_future(engine.infer("line", LINE))
        await reach(engine, lambda s: s.queued == 1)
        await asyncio.sleep(0)
        yield engine, clock, online, line


def online_wait_s(engine: Engine) -> float:
    assert engine.metrics is not None
    return engine.metrics.snapshot()["batch_api"]["online_wait_s"]


def lines_waiting(engine: Engine) -> int:
    assert engine.metrics is not None
    return engine.metrics.snapshot()["batch_api"]["waiting"]


async def test_a_free_device_held_for_waiting_online_requests_is_not_idle_time(gated):
    """A policy lingering for a fuller batch keeps the device free while an online request
    waits; lines wait too (they never run then), and that time is counted apart from the
    idle time they could have used: 50 ms of virtual linger here, nothing once it left."""
    async with lingering_beside_a_line(gated) as (engine, clock, online, line):
        assert not gated.calls  # the device stays free: the online request lingers
        clock.advance(0.030)
        mid_linger = online_wait_s(engine)  # a scrape mid-linger sees the wait so far
        clock.advance(0.020)  # its linger ends: it leaves, then the line runs
        assert (await online).output == "enilno"
        assert (await line).output == "enil"
        waited = online_wait_s(engine)
        clock.advance(1.0)  # nothing waits: no more is counted
        assert online_wait_s(engine) == waited
    assert mid_linger == pytest.approx(0.030)
    assert waited == pytest.approx(0.050)
    assert calls(gated) == [["online"], ["line"]]


async def line_leaves_mid_linger(
    clock: FakeClock, online: asyncio.Future[Result], line: asyncio.Future[Result]
) -> None:
    """10 ms into the 50 ms linger the line's handler leaves; then the linger ends and the
    online request is answered."""
    clock.advance(0.010)
    line.cancel()  # its handler leaves: nothing is left to use idle time
    with pytest.raises(asyncio.CancelledError):
        await line
    clock.advance(0.040)  # the linger ends
    assert (await online).output == "enilno"


async def test_online_waiting_stops_counting_when_the_last_line_leaves(gated):
    """By default it is counted only while lines wait: what they could not use. Counting at
    every change costs the request path (`--count-online-wait`)."""
    async with lingering_beside_a_line(gated) as (engine, clock, online, line):
        await line_leaves_mid_linger(clock, online, line)
        waited = online_wait_s(engine)
    assert waited == pytest.approx(0.010)


async def test_online_waiting_is_counted_without_lines_where_asked(gated):
    """--count-online-wait: the control the Batch API's benchmark reads in its window
    without a batch. A line that leaves, or none at all, does not stop the count."""
    asked = {"count_online_wait": True}
    async with lingering_beside_a_line(gated, **asked) as (engine, clock, online, line):
        await line_leaves_mid_linger(clock, online, line)
        after_one = online_wait_s(engine)
        alone = asyncio.ensure_future(engine.infer("alone"))
        await reach(engine, lambda s: s.queued == 1)
        clock.advance(0.050)
        assert (await alone).output == "enola"
        after_two = online_wait_s(engine)
    assert after_one == pytest.approx(0.050)
    assert after_two == pytest.approx(0.100)
    assert calls(gated) == [["online"], ["alone"]]


async def test_a_free_device_barred_to_lines_by_waiting_online_requests_is_counted(gated):
    """Model "a" has only sim:0, busy with its first request, and its second waits; sim:1 is
    free and holds only "b", which shares sim:0 with "a". Lines of "b" may not run anywhere
    while "a" waits (`_idle_batch`), so sim:1's free time is online waiting, not idle
    capacity: a line offered meanwhile runs only once "a" is done. (Simulated devices cannot
    place "b" apart from "a": `sim:N` is always sim:0 onwards.)"""
    models = [
        ModelSpec(name="a", version="1", fn_per_device=gated, devices="sim:1", max_linger_ms=0),
        ModelSpec(name="b", version="1", fn_per_device=gated, devices="sim:2", max_linger_ms=0),
    ]
    async with Engine(Config(), models=models, clock=FakeClock()) as engine:
        clock = engine.clock
        assert isinstance(clock, FakeClock)
        first = asyncio.ensure_future(engine.infer(Ask("first", model="a")))
        await reach(engine, lambda s: s.in_flight == 1)
        second = asyncio.ensure_future(engine.infer(Ask("second", model="a")))
        await reach(engine, lambda s: s.queued == 1)
        line = asyncio.ensure_future(engine.infer(Ask("line", model="b"), LINE))
        await until(lambda: lines_waiting(engine) == 1)
        clock.advance(0.040)
        counted = online_wait_s(engine)
        line_waited = not line.done()
        gated.gate.set()
        outputs = [(await request).output for request in (first, second, line)]
    assert outputs == ["tsrif", "dnoces", "enil"]
    assert line_waited
    assert counted == pytest.approx(0.040)
