"""Batches cut short while several tenants send to one model (rules/sharing.py, issue #42):
one tenant's long list may not make another's single input wait for two full batches."""

from __future__ import annotations

import asyncio
import queue
import threading

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Caller
from batchserve.models.backends import simulate
from batchserve.models.specs import BatchFn, ModelSpec
from batchserve.rules.sharing import Senders, shared_count
from batchserve.rules.tenants import Tenant

from .conftest import HANG_GUARD_S

FIXED_S, PER_TOKEN_S = 0.013, 0.0004
"""A call's cost, shaped like MiniLM's on one CPU thread: 13 ms, and 2 ms a 5-token input."""


def test_senders_tell_whether_another_tenant_sent_lately():
    senders = Senders()
    assert not senders.other_since("bulk", 0.0)
    senders.heard("bulk", 10.0)
    assert not senders.other_since("bulk", 0.0)
    assert senders.other_since("single", 9.0)
    senders.heard("single", 11.0)
    senders.heard("single", 12.0)
    assert senders.other_since("bulk", 11.5)  # single, at 12
    assert senders.other_since("single", 10.0)  # bulk, at 10
    assert not senders.other_since("single", 10.5)
    senders.heard("third", 13.0)
    assert senders.other_since("single", 12.5)  # third, at 13


def test_a_shared_batch_fits_a_few_one_input_times_and_a_flat_one_is_not_cut():
    def line(size: int) -> float:
        return 0.013 + 0.002 * size  # one input 15 ms: three of those fit 16 inputs

    assert shared_count(100, 3.0, line) == 16
    assert shared_count(100, 1.0, line) == 1
    assert shared_count(10, 3.0, line) == 10
    assert shared_count(100, 0.0, line) == 100  # off
    assert shared_count(100, 3.0, lambda size: 0.2) == 100  # flat: size costs nothing
    assert shared_count(100, 3.0, None) == 3  # not learned yet: what fits at any fixed cost
    assert shared_count(100, 2.5, None) == 2
    assert shared_count(1, 3.0, None) == 1


class Stepped:
    """A device factory whose every call waits for the test, which first moves the fake
    clock by the call's cost (FIXED_S + PER_TOKEN_S a padded token): the batch-time line is
    then learned from the calls themselves, as on a real device."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.entered: queue.Queue[tuple[list[str], threading.Event]] = queue.Queue()

    def __call__(self, device: str) -> BatchFn:
        def run(inputs: list[str]) -> list[str]:
            done = threading.Event()
            self.entered.put((list(inputs), done))
            done.wait(HANG_GUARD_S)
            return [simulate(text) for text in inputs]

        return run

    async def started(self) -> tuple[list[str], threading.Event]:
        """The next call, once it has entered its device."""
        return await asyncio.to_thread(self.entered.get, True, HANG_GUARD_S)

    def end(self, call: tuple[list[str], threading.Event]) -> list[str]:
        """Lets `call` take its time and return; its inputs."""
        inputs, done = call
        self.clock.advance(FIXED_S + PER_TOKEN_S * 5 * len(inputs))
        done.set()
        return inputs

    async def finish(self) -> list[str]:
        return self.end(await self.started())


async def test_a_long_lists_batches_are_cut_while_another_tenant_sends():
    """Bulk sends 500 five-character inputs; its first call takes the 100 the model allows,
    since no one else sends. Single's one input arrives during it and rides in the next
    call, which is cut to what fits three one-input times (15.8 ms predicted, inputs padded
    to their bucket's 7: 13 ms + 2.8 ms each, so 12 inputs). So is every call that starts
    within PRESENT_S of single's arrival: the 100-input call took 213 ms and each cut one
    takes 37 ms, so 22 of them; then bulk's calls are full again."""
    clock = FakeClock()
    stepped = Stepped(clock)
    model = ModelSpec(
        name="m", version="1", fn_per_device=stepped, devices="sim:1", cost="length"
    )  # fmt: skip
    bulk, single = Tenant("bulk", "paid"), Tenant("single", "paid")
    config = Config(shared_batch_ratio=3.0)
    async with Engine(config, models=[model], clock=clock) as engine:
        learn = [engine.submit("a0000", Caller(tenant=bulk))]
        call = await stepped.started()
        learn += [engine.submit(f"a{n:04d}", Caller(tenant=bulk)) for n in range(1, 11)]
        assert [len(stepped.end(call)), len(await stepped.finish())] == [1, 10]  # the line
        await asyncio.gather(*learn)
        tickets = [engine.submit(f"b{n:04d}", Caller(tenant=bulk)) for n in range(500)]
        call = await stepped.started()
        tickets.append(engine.submit("s0000", Caller(tenant=single)))
        assert len(stepped.end(call)) == 100
        beside = await stepped.finish()
        assert "s0000" in beside
        assert len(beside) == 12
        sizes = [len(await stepped.finish()) for _ in range(23)]
        await asyncio.gather(*tickets)
    assert sizes == [12] * 21 + [100, 37]


async def test_before_the_cost_line_is_learned_a_shared_batch_takes_ratio_inputs():
    """Nothing yet says how the batch time grows with its size (one call seen), so a list's
    batch beside another tenant takes the 3 inputs that fit three one-input times at any
    fixed cost, not all 50 (a batch the other tenant would wait behind)."""
    clock = FakeClock()
    stepped = Stepped(clock)
    model = ModelSpec(
        name="m", version="1", fn_per_device=stepped, devices="sim:1", cost="length"
    )  # fmt: skip
    bulk, single = Tenant("bulk", "paid"), Tenant("single", "paid")
    async with Engine(Config(shared_batch_ratio=3.0), models=[model], clock=clock) as engine:
        tickets = [engine.submit("s0000", Caller(tenant=single))]
        call = await stepped.started()
        tickets += [engine.submit(f"b{n:04d}", Caller(tenant=bulk)) for n in range(50)]
        stepped.end(call)
        assert len(await stepped.finish()) == 3
        # Two sizes seen: the line is learned, and the cut follows it (12, as above).
        assert [len(await stepped.finish()) for _ in range(4)] == [12, 12, 12, 11]
        await asyncio.gather(*tickets)
