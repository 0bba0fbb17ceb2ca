"""The Batch API's tier, in the engine alone: virtual time, a gated device. A batch line
waits below every online request, never rides in an online batch, and keeps no online
request waiting longer than the one batch call on the device."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from batchserve import Caller, Config, Engine
from batchserve.clock import FakeClock
from batchserve.config import POISON_MARKER
from batchserve.errors import BackendError
from batchserve.models.backends import simulate
from batchserve.rules.tenants import Tenant

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
