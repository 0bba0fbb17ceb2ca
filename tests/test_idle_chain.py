"""The Batch API's idle calls back to back (devices/prepared.py), in the engine alone and
virtual time: the device's thread starts the next idle call itself as the last returns (no
loop round trip between them), and that call is withdrawn, never started, the moment online
work for its version arrives, so online work finds at most the one call in hand ahead of it.
The stepped device (test_idle_calls.py) shows which call the thread started with the loop
held: only one prepared beforehand can run then."""

from __future__ import annotations

import asyncio

from batchserve.models.backends import simulate

from .conftest import reach
from .test_idle_calls import LINE, lines, measured, ran, stepped_engine, submit


def batch_api(engine: object) -> tuple[int, int, int]:
    """The idle lines waiting, running and done, as /metrics reads them."""
    counts = engine.metrics.snapshot()["batch_api"]  # type: ignore[attr-defined]
    return counts["waiting"], counts["running"], counts["done"]


async def test_the_device_starts_the_next_idle_call_itself_and_counts_it_waiting_till_then():
    async with stepped_engine(idle_call_ms=1.5) as (engine, stepped, clock):  # one line a call
        waiting = await measured(engine, stepped, clock, lambda: submit(engine, lines(3), LINE))
        assert await stepped.entered() == ["line-00"]
        assert batch_api(engine) == (2, 1, 0)  # line-01, prepared behind it, still waits
        assert stepped.started_itself(clock) == ["line-01"]
        await waiting[0]  # the loop heard of line-00's end: line-02 is prepared
        assert batch_api(engine) == (1, 1, 1)
        assert stepped.started_itself(clock) == ["line-02"]
        stepped.finish(clock)
        results = await asyncio.gather(*waiting)
        assert batch_api(engine) == (0, 0, 3)
    assert [r.output for r in results] == [simulate(text) for text in lines(3)]


async def test_online_work_withdraws_the_prepared_call_and_goes_next():
    async with stepped_engine(idle_call_ms=1.5) as (engine, stepped, clock):
        waiting = await measured(engine, stepped, clock, lambda: submit(engine, lines(4), LINE))
        assert await stepped.entered() == ["line-00"]  # line-01 prepared behind it
        online = submit(engine, ["on-0005"])
        await reach(engine, lambda s: s.queued == 1)
        stepped.finish(clock)
        assert await stepped.through(clock) == ["on-0005"]  # one idle call ahead, no more
        assert await stepped.entered() == ["line-01"]  # back in the idle tier, first
        assert stepped.started_itself(clock) == ["line-02"]  # and the chain forms again
        await waiting[1]
        assert stepped.started_itself(clock) == ["line-03"]
        stepped.finish(clock)
        results = await asyncio.gather(*waiting)
        assert (await online[0]).output == simulate("on-0005")
        assert batch_api(engine) == (0, 0, 4)
    assert [r.output for r in results] == [simulate(text) for text in lines(4)]
    assert [len(call) for call in stepped.calls[3:]] == [1, 1, 1, 1, 1]  # each line ran once


async def test_a_failed_chained_call_goes_back_to_the_idle_tier_behind_online_work():
    # 2 lines a call (3 ms predicted, within 3.5 ms); the second call, started by the thread
    # itself, fails: its halves run again in idle time, after the online request.
    async with stepped_engine(idle_call_ms=3.5) as (engine, stepped, clock):
        stepped.fail_together = {"line-03"}
        waiting = await measured(engine, stepped, clock, lambda: submit(engine, lines(4), LINE))
        assert await stepped.entered() == lines(2)
        assert stepped.started_itself(clock) == lines(4)[2:]
        online = submit(engine, ["on-0005"])
        await reach(engine, lambda s: s.queued == 1)
        stepped.finish(clock)  # it raises
        assert await stepped.through(clock) == ["on-0005"]
        assert await ran(stepped, clock, 2) == [1, 1]
        results = await asyncio.gather(*waiting)
        assert (await online[0]).output == simulate("on-0005")
        assert batch_api(engine) == (0, 0, 4)
    assert stepped.calls[-2:] == [["line-02"], ["line-03"]]
    assert [r.output for r in results] == [simulate(text) for text in lines(4)]
