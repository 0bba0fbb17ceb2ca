"""The Batch API's tier, in the engine alone: virtual time, a gated device. A batch line
waits below every online request, never rides in an online batch, and keeps no online
request waiting longer than the one batch call on the device."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from batchserve import Caller, Config, Engine
from batchserve.clock import FakeClock

from .conftest import GatedBackend, reach
from .test_batch_api import IDLE

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
