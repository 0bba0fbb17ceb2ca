"""The size of a Batch API call (`--idle-call-ms`), in the engine alone and virtual time: an
online request arriving finds at most one idle call ahead of it, so that call holds only
the lines its model's estimate predicts done within the bound, at least one. The device is
stepped by the test, which moves the clock by each call's cost while it runs, so the
model's estimate learns that cost as it would on a real device."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from batchserve import Caller, Config, Engine
from batchserve.batching.request import Result
from batchserve.clock import FakeClock
from batchserve.devices.loading import WARM_UP_INPUT
from batchserve.models.backends import simulate
from batchserve.models.specs import BatchFn, ModelSpec

from .conftest import HANG_GUARD_S, reach
from .test_batch_api import IDLE

LINE = Caller(tenant=IDLE)


def cost_s(size: int) -> float:
    """The stepped device's call: 1 ms, plus 1 ms a line (every input here is 7 characters,
    the top of its length bucket, so the padded size the estimate predicts is the real one)."""
    return 0.001 * (1 + size)


class Stepped:
    """A device factory whose calls each wait for the test to let them through, one at a
    time (the warm-up call passes at once); a call of more than one input that holds one
    of `fail_together` then raises."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.fail_together: set[str] = set()
        self._entered = threading.Semaphore(0)
        self._go = threading.Semaphore(0)

    def __call__(self, device: str) -> BatchFn:
        def run(inputs: list[str]) -> list[str]:
            if inputs != [WARM_UP_INPUT]:
                self.calls.append(list(inputs))
                self._entered.release()
                assert self._go.acquire(timeout=HANG_GUARD_S), "the test never let it go"
            if len(inputs) > 1 and self.fail_together.intersection(inputs):
                raise RuntimeError("a call that fails until split")
            return [simulate(text) for text in inputs]

        return run

    async def entered(self) -> list[str]:
        """The inputs of the next call, once it runs."""
        assert await asyncio.to_thread(self._entered.acquire, True, HANG_GUARD_S), "no call"
        return self.calls[-1]

    def finish(self, clock: FakeClock) -> None:
        """Lets the running call return, the clock moved by its cost meanwhile."""
        clock.advance(cost_s(len(self.calls[-1])))
        self._go.release()

    def started_itself(self, clock: FakeClock) -> list[str]:
        """Lets the running call return and, holding the event loop (this does not await),
        waits for the next call to run: only one the device's thread started of itself,
        with no loop round trip, can."""
        self.finish(clock)
        assert self._entered.acquire(timeout=HANG_GUARD_S), "the thread started nothing"
        return self.calls[-1]

    async def through(self, clock: FakeClock) -> list[str]:
        inputs = await self.entered()
        self.finish(clock)
        return inputs


@asynccontextmanager
async def stepped_engine(
    cost: str = "length", **settings: object
) -> AsyncIterator[tuple[Engine, Stepped, FakeClock]]:
    stepped, clock = Stepped(), FakeClock()
    spec = ModelSpec(
        name="m",
        version="1",
        fn_per_device=stepped,
        devices="sim:1",
        cost=cost,  # type: ignore[arg-type]
    )
    config = Config(**settings)  # type: ignore[arg-type]
    async with Engine(config, models=[spec], clock=clock) as engine:
        yield engine, stepped, clock


def submit(
    engine: Engine, texts: list[str], caller: Caller | None = None
) -> list[asyncio.Future[Result]]:
    return [asyncio.ensure_future(engine.infer(text, caller)) for text in texts]


async def measured(
    engine: Engine,
    stepped: Stepped,
    clock: FakeClock,
    then: Callable[[], list[asyncio.Future[Result]]],
) -> list[asyncio.Future[Result]]:
    """Two online calls, of one request and of two, teach the estimate `cost_s`; `then` runs
    while the second is on the device, so what it submits (returned) waits for it."""
    await asyncio.gather(*submit(engine, ["on-0001"]), stepped.through(clock))
    one = submit(engine, ["on-0002"])
    await stepped.entered()
    pair = submit(engine, ["on-0003", "on-0004"])
    await reach(engine, lambda s: s.queued == 2)
    stepped.finish(clock)
    await asyncio.gather(*one)
    assert await stepped.entered() == ["on-0003", "on-0004"]
    submitted = then()
    stepped.finish(clock)
    await asyncio.gather(*pair)
    return submitted


async def ran(stepped: Stepped, clock: FakeClock, count: int) -> list[int]:
    """The sizes of the calls that run `count` lines, each let through in turn."""
    sizes: list[int] = []
    while sum(sizes) < count:
        sizes.append(len(await stepped.through(clock)))
    return sizes


def lines(count: int) -> list[str]:
    return [f"line-{n:02d}" for n in range(count)]


async def test_an_idle_call_holds_only_the_lines_predicted_done_within_the_bound():
    # Predicted 1 ms + 1 ms a line: 3 lines (4 ms) fit 4.5 ms, 4 (5 ms) do not.
    async with stepped_engine(idle_call_ms=4.5) as (engine, stepped, clock):
        waiting = await measured(engine, stepped, clock, lambda: submit(engine, lines(10), LINE))
        sizes = await ran(stepped, clock, 10)
        results = await asyncio.gather(*waiting)
    assert sizes == [3, 3, 3, 1]
    assert [result.output for result in results] == [simulate(text) for text in lines(10)]


async def test_a_line_predicted_past_the_bound_still_runs_alone():
    # One line is predicted 2 ms, past 1.5 ms: the shortest call there is, one line each.
    async with stepped_engine(idle_call_ms=1.5) as (engine, stepped, clock):
        waiting = await measured(engine, stepped, clock, lambda: submit(engine, lines(3), LINE))
        sizes = await ran(stepped, clock, 3)
        await asyncio.gather(*waiting)
    assert sizes == [1, 1, 1]


async def test_online_batches_are_not_bounded_by_it():
    async with stepped_engine(idle_call_ms=1.5) as (engine, stepped, clock):
        online = [f"on-{n:04d}" for n in range(10, 15)]
        waiting = await measured(engine, stepped, clock, lambda: submit(engine, online))
        assert await stepped.through(clock) == online  # 6 ms predicted: one call all the same
        await asyncio.gather(*waiting)


async def test_a_flat_cost_models_lines_go_in_full_batches():
    # Its estimate predicts the same time at any size: fewer lines would be no shorter.
    async with stepped_engine(cost="flat", idle_call_ms=1.5) as (engine, stepped, clock):
        waiting = await measured(engine, stepped, clock, lambda: submit(engine, lines(5), LINE))
        assert await stepped.through(clock) == lines(5)
        await asyncio.gather(*waiting)


async def test_lines_shrink_before_the_estimate_has_seen_two_sizes():
    # Only full calls seen, the estimate is their mean at any size (5 ms, past 4.5 ms): one
    # line, whose call gives it a slope. Read as a flat model's, it stayed full for good.
    # The call after that line's is prepared as it starts (devices/prepared.py), before
    # its time is known: one line too.
    async with stepped_engine(idle_call_ms=4.5) as (engine, stepped, clock):
        first = submit(engine, lines(4), LINE)
        assert await stepped.entered() == lines(4)  # nothing timed yet: a full batch
        more = submit(engine, [f"more-{n:02d}" for n in range(8)], LINE)
        stepped.finish(clock)
        sizes = await ran(stepped, clock, 8)
        await asyncio.gather(*first, *more)
    assert sizes == [1, 1, 3, 3]
