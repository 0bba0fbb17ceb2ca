"""The hang budget of a generation step follows the step's predicted cost: a heavy but healthy
step (a long prompt's prefill) is not taken for a hang because earlier steps were light."""

from __future__ import annotations

import asyncio
import queue
import threading

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Prompt
from batchserve.models.generators import Seq, sim_token
from batchserve.models.specs import ModelSpec
from batchserve.rules.capacity import BatchBudget, StepCost

from .conftest import HANG_GUARD_S

FIXED_S, PER_TOKEN_S = 0.010, 0.001
"""What a light step costs on the fake clock: 10 ms and 1 ms per token it processes."""
HEAVY_TOKENS, HEAVY_PER_TOKEN_S = 100, 0.006
"""A step of more tokens is bound by arithmetic, not by reading the weights: 6 ms a token,
six times what the light steps' line says (a real prefill's ratio on a CPU is 3-5)."""


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
        per_token_s = HEAVY_PER_TOKEN_S if processed > HEAVY_TOKENS else PER_TOKEN_S
        self.costs.put(FIXED_S + per_token_s * processed)
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
    async with Engine(Config(timeout_ms=60_000), models=[spec], clock=clock) as engine:
        # Light steps first: a 4-token prefill (14 ms) and decodes (11 ms each). The old rule,
        # 5x the longest step seen with a 1 s floor, allowed 1 s to any step after them.
        driver = asyncio.ensure_future(drive(generator, clock, 5))
        async with engine.generate("abcd") as gen:
            assert await gen.result() == "dcba"
        await driver
        # A 1,000-token prompt's prefill costs 6.01 s: healthy, though the light steps' line
        # says 1.01 s (a budget of 5.05 s); past the largest step seen, the prediction
        # scales that step's time (14 ms for 4 tokens) by the tokens: 3.5 s, a 17.5 s budget.
        driver = asyncio.ensure_future(drive(generator, clock, 1))
        async with engine.generate(Prompt("k" * 1000, max_tokens=1)) as gen:
            assert await gen.result() == "k"
        await driver
        assert engine.metrics is not None
        (row,) = engine.metrics.snapshot()["generation"]
        assert row["hung_steps"] == 0


def test_the_budget_is_five_times_the_predicted_cost_of_the_tokens_in_hand():
    cost = StepCost()
    for tokens in (4, 1, 1, 16, 1, 8):
        cost.observe(FIXED_S + PER_TOKEN_S * tokens, tokens)
    budget = BatchBudget()
    assert budget.seconds(cost.predict(1)) == 1.0  # the floor, for a light step
    assert abs(cost.predict(12) - (FIXED_S + PER_TOKEN_S * 12)) < 1e-9  # the line, inside
    largest = FIXED_S + PER_TOKEN_S * 16
    assert abs(cost.predict(1500) - largest * 1500 / 16) < 1e-9  # scaled past the largest
