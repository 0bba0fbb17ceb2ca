"""Prefill shared fairly: a long prompt in line does not hold short prompts' first tokens
past their fair share of the steps (counted in steps), and tenants share a step's prefill by
weight."""

from __future__ import annotations

import asyncio
import math
import threading

from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.models.generators import Made, Seq, sim_token
from batchserve.models.specs import ModelSpec
from batchserve.rules.prefill import (
    Prefill,
    fair_split,
)
from batchserve.rules.tenants import Tenant

from .conftest import HANG_GUARD_S

STEP_TOKENS = 16


class ChunkedGenerator:
    """Prefills in the chunks it is handed (instant), answering the simulated generator's
    tokens; records what each step carried, and holds its first step until let go."""

    chunked_prefill = True
    kv_budget_tokens = 10_000

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self.first_token_step: dict[str, int] = {}
        self.first_step_go = threading.Event()
        self.first_step_entered = threading.Event()
        self._computed: dict[str, int] = {}

    def count_tokens(self, text: str) -> int:
        return len(text)

    def step(self, seqs: list[Seq]) -> list[Made]:
        if not self.steps:
            self.first_step_entered.set()
            assert self.first_step_go.wait(HANG_GUARD_S), "the test never let the step go"
        carried: dict[str, int] = {}
        answers: list[Made] = []
        for seq in seqs:
            need = len(seq.prompt) + len(seq.tokens) - self._computed.get(seq.id, 0)
            take = need if seq.chunk is None else seq.chunk
            self._computed[seq.id] = self._computed.get(seq.id, 0) + take
            carried[seq.id] = take
            if take < need:
                answers.append(Made())
                continue
            self.first_token_step.setdefault(seq.id, len(self.steps))
            token = sim_token(seq.prompt, len(seq.tokens))
            answers.append(Made(end=True) if token is None else Made(token, ord(token)))
        self.steps.append(carried)
        return answers

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._computed.pop(seq_id, None)


def chunked_engine(generator: ChunkedGenerator, **settings: object) -> Engine:
    spec = ModelSpec(name="writer", version="1", generator=lambda d: generator, devices="sim:1")
    return Engine(Config(step_tokens=STEP_TOKENS, **settings), models=[spec])  # type: ignore[arg-type]


async def run_to_end(engine: Engine, prompt: str, request_id: str, **asks: object) -> str:
    async with engine.generate(prompt, request_id=request_id, **asks) as gen:  # type: ignore[arg-type]
        return await gen.result()


async def test_a_long_prompt_in_line_holds_short_first_tokens_only_to_their_fair_share():
    generator = ChunkedGenerator()
    async with chunked_engine(generator) as engine:
        long = asyncio.ensure_future(run_to_end(engine, "L" * 200, "long", max_tokens=1))
        assert await asyncio.to_thread(generator.first_step_entered.wait, HANG_GUARD_S)
        shorts = [
            asyncio.ensure_future(run_to_end(engine, "s" * 10, f"s{n}", max_tokens=1))
            for n in range(3)
        ]
        await asyncio.sleep(0)
        generator.first_step_go.set()
        assert await asyncio.gather(*shorts) == ["s"] * 3
        await long
    # From step 1 four prompts prefill: each short gets a quarter of a step's 16 tokens,
    # so its 10 tokens are in within ceil(10 / 4) steps; in arrival order the long prompt's
    # 184 tokens left would take the next 12 steps first.
    joined = 1
    fair = joined + math.ceil(10 / (STEP_TOKENS // 4)) - 1
    assert all(generator.first_token_step[f"s{n}"] <= fair for n in range(3))
    assert generator.steps[1] == {"long": 4, "s0": 4, "s1": 4, "s2": 4}
    assert all(sum(step.values()) <= STEP_TOKENS for step in generator.steps)


async def test_two_tenants_share_a_steps_prefill_by_weight_not_by_their_count():
    generator = ChunkedGenerator()
    many, one = Tenant("many", "free"), Tenant("one", "free")
    async with chunked_engine(generator) as engine:
        first = asyncio.ensure_future(run_to_end(engine, "a" * 100, "a0", tenant=many))
        assert await asyncio.to_thread(generator.first_step_entered.wait, HANG_GUARD_S)
        rest = [
            asyncio.ensure_future(run_to_end(engine, "a" * 100, f"a{n}", tenant=many))
            for n in (1, 2)
        ]
        theirs = asyncio.ensure_future(run_to_end(engine, "b" * 100, "b", tenant=one))
        await asyncio.sleep(0)
        generator.first_step_go.set()
        await asyncio.gather(first, *rest, theirs)
    step = next(step for step in generator.steps if len(step) == 4)
    keys = [key for key in step if key != "3:one:b"]
    assert step["3:one:b"] == STEP_TOKENS // 2  # half the step, against three prompts
    assert sorted(step[key] for key in keys) == [2, 3, 3]


def test_fair_split_shares_by_tenant_then_by_prompt_and_gives_back_what_is_not_needed():
    def split(budget: int, *wants: tuple[str, float, int]) -> list[int]:
        return fair_split(budget, [Prefill(*want) for want in wants])

    assert split(16, ("", 1, 200), ("", 1, 10), ("", 1, 10)) == [6, 5, 5]
    assert split(16, ("", 1, 200), ("", 1, 2), ("", 1, 3)) == [11, 2, 3]
    assert split(16, ("a", 1, 100), ("a", 1, 100), ("b", 1, 100)) == [4, 4, 8]
    assert split(12, ("a", 2, 100), ("b", 1, 100)) == [8, 4]
    assert split(3, *[("", 1, 5)] * 5) == [1, 1, 1, 0, 0]
    assert split(0, ("", 1, 5)) == [0]
    assert split(100, ("a", 1, 5), ("b", 1, 7)) == [5, 7]
