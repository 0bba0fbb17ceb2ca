"""The hang budget of a generation step follows the step's predicted cost: a heavy but healthy
step (a long prompt's prefill) is not taken for a hang because earlier steps were light."""

from __future__ import annotations

import asyncio
import queue
import threading

from batchserve.capacity import BatchBudget, LengthCost
from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine import Engine
from batchserve.generators import Seq, sim_token
from batchserve.specs import ModelSpec

from .conftest import HANG_GUARD_S

FIXED_S, PER_TOKEN_S = 0.010, 0.001
"""What a step costs on the fake clock: 10 ms and 1 ms per token it processes."""


class TimedGenerator:
    """The simulated answers; each step tells the test its cost, then waits to be let go."""

    kv_budget_tokens = 10_000

    def __init__(self) -> None:
        self.costs: queue.SimpleQueue[float] = queue.SimpleQueue()
        self.go = threading.Event()
        self._prefilled: set[str] = set()

    def count_tokens(self, text: str) -> int:
        return len(text)

    def step(self, seqs: list[Seq]) -> list[str | None]:
        new = [s for s in seqs if s.id not in self._prefilled]
        processed = sum(len(s.prompt) + len(s.tokens) for s in new) + len(seqs) - len(new)
        self._prefilled.update(s.id for s in new)
        self.costs.put(FIXED_S + PER_TOKEN_S * processed)
        assert self.go.wait(HANG_GUARD_S), "the test never let the step go"
        self.go.clear()
        return [sim_token(s.prompt, len(s.tokens)) for s in seqs]

    def release(self, seq_ids: list[str]) -> None:
        self._prefilled.difference_update(seq_ids)


async def drive(generator: TimedGenerator, clock: FakeClock, steps: int) -> None:
    """Lets `steps` steps run, each after moving the clock by what it costs."""
    for _ in range(steps):
        cost = await asyncio.to_thread(generator.costs.get, True, HANG_GUARD_S)
        clock.advance(cost)
        generator.go.set()


async def test_a_long_prefill_after_light_steps_is_not_taken_for_a_hang():
    generator = TimedGenerator()
    clock = FakeClock()
    spec = ModelSpec(name="writer", version="1", generator=lambda d: generator, devices="sim:1")
    async with Engine(Config(), models=[spec], clock=clock) as engine:
        # Light steps first: a 4-token prefill (14 ms) and decodes (11 ms each). The old rule,
        # 5x the longest step seen with a 1 s floor, allowed 1 s to any step after them.
        driver = asyncio.ensure_future(drive(generator, clock, 5))
        async with engine.generate("abcd") as gen:
            assert await gen.result() == "dcba"
        await driver
        # A 1,000-token prompt's prefill costs 1.01 s: healthy, and predicted as such.
        driver = asyncio.ensure_future(drive(generator, clock, 1))
        async with engine.generate("k" * 1000, max_tokens=1) as gen:
            assert await gen.result() == "k"
        await driver
        assert engine.metrics is not None
        (row,) = engine.metrics.snapshot()["generation"]
        assert row["hung_steps"] == 0


def test_the_budget_is_five_times_the_predicted_cost_of_the_tokens_in_hand():
    cost = LengthCost()
    for tokens in (4, 1, 1, 16, 1, 8):
        cost.observe(FIXED_S + PER_TOKEN_S * tokens, tokens)
    budget = BatchBudget()
    assert budget.seconds(cost.predict(1)) == 1.0  # the floor, for a light step
    assert abs(budget.seconds(cost.predict(1500)) - 5 * (FIXED_S + 1.5)) < 1e-6
