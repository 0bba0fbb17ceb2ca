"""Prefill shared fairly and the first-token deadline: a long prompt in line does not hold
short prompts' first tokens past their fair share of the steps (counted in steps), tenants
share a step's prefill by weight, a generation predicted to miss its first token is refused
at arrival before any device sees it, and a generation's deadline is its own default."""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Caller, Prompt
from batchserve.errors import DeadlineExceeded, Overloaded
from batchserve.models.generators import Made, Seq, sim_token
from batchserve.models.specs import ModelSpec
from batchserve.rules.capacity import PrefillCost
from batchserve.rules.prefill import (
    Prefill,
    PrefillLine,
    fair_split,
    refuse_if_late,
    work_until_done,
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
    """Steps of STEP_TOKENS, whether a sequence decodes or not (unless `settings` say)."""
    spec = ModelSpec(name="writer", version="1", generator=lambda d: generator, devices="sim:1")
    settings = {"step_tokens": STEP_TOKENS, "prefill_step_tokens": STEP_TOKENS, **settings}
    return Engine(Config(**settings), models=[spec])  # type: ignore[arg-type]


async def run_to_end(
    engine: Engine,
    prompt: str,
    request_id: str,
    max_tokens: int | None = None,
    tenant: Tenant | None = None,
) -> str:
    asked = Prompt(prompt, max_tokens=max_tokens)
    async with engine.generate(asked, Caller(request_id=request_id, tenant=tenant)) as gen:
        return await gen.result()


async def in_line(engine: Engine, waiting: int) -> None:
    """Until `waiting` generations wait in line (their prompts are counted on a thread)."""
    assert engine.metrics is not None
    deadline = time.monotonic() + HANG_GUARD_S
    while engine.metrics.snapshot()["generation"][0]["waiting"] < waiting:
        assert time.monotonic() < deadline, "they never joined the line"
        await asyncio.sleep(0)


async def test_a_long_prompt_in_line_holds_short_first_tokens_only_to_their_fair_share():
    generator = ChunkedGenerator()
    async with chunked_engine(generator) as engine:
        long = asyncio.ensure_future(run_to_end(engine, "L" * 200, "long", max_tokens=1))
        assert await asyncio.to_thread(generator.first_step_entered.wait, HANG_GUARD_S)
        shorts = [
            asyncio.ensure_future(run_to_end(engine, "s" * 10, f"s{n}", max_tokens=1))
            for n in range(3)
        ]
        await in_line(engine, 3)  # each counted on the tokenizer's thread, then in line
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


async def test_a_step_takes_the_prefill_budget_only_while_no_sequence_decodes():
    """A step takes up to --prefill-step-tokens (64) while every sequence in it prefills;
    beside a stream that decodes, --step-tokens (16): its one token, then 15 of a prompt."""
    generator = ChunkedGenerator()
    async with chunked_engine(generator, prefill_step_tokens=64) as engine:
        stream = asyncio.ensure_future(run_to_end(engine, "d" * 30, "stream", max_tokens=30))
        assert await asyncio.to_thread(generator.first_step_entered.wait, HANG_GUARD_S)
        beside = asyncio.ensure_future(run_to_end(engine, "b" * 200, "beside", max_tokens=1))
        await in_line(engine, 1)
        generator.first_step_go.set()
        assert await asyncio.gather(stream, beside) == ["d" * 30, "b"]
        assert await run_to_end(engine, "a" * 200, "alone", max_tokens=1) == "a"
    assert generator.steps[0] == {"stream": 30}
    assert [step["beside"] for step in generator.steps if "beside" in step] == [15] * 13 + [5]
    assert [step["alone"] for step in generator.steps if "alone" in step] == [64, 64, 64, 8]


async def test_the_prefill_forecast_counts_steps_of_the_budget_they_will_have():
    """A device with nothing running forecasts a prompt in steps of --prefill-step-tokens;
    with a stream decoding, in steps of --step-tokens less its token (step time 0.1 s +
    1 ms a token, as fitted from the steps seen)."""
    generator = ChunkedGenerator()
    async with chunked_engine(generator, prefill_step_tokens=64) as engine:
        (model,) = list(engine._generators)
        loop = model.loops[0]
        for tokens in (16, 32, 64, 16, 64):
            loop.prefill_cost.observe(0.1 + 0.001 * tokens, tokens)
        assert loop.prefill_seconds(50) == pytest.approx(0.15)  # one step: it fits
        assert loop.prefill_seconds(640) == pytest.approx(10 * 0.164)  # ten steps of 64
        loop.running = [SimpleNamespace(prefill_tokens=0)]  # a stream decoding, between steps
        try:
            # Steps of 16: its token and 15 of the prompt's, 0.116 s each.
            assert loop.prefill_seconds(150) == pytest.approx(150 / 15 * 0.116)
            assert loop.prefill_seconds(640, alone=True) == pytest.approx(10 * 0.164)
        finally:
            loop.running = []


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


class TimedGenerator:
    """Whole prompts a step (no chunks), the simulated answers; each step tells the test its
    cost (FIXED_S + PER_TOKEN_S a token processed), then waits to be let go. Records the
    ids of every sequence it was handed."""

    kv_budget_tokens = 10_000

    def __init__(self, per_token_s: float) -> None:
        self.per_token_s = per_token_s
        self.costs: queue.SimpleQueue[float | None] = queue.SimpleQueue()
        self.go = threading.Event()
        self.seen: set[str] = set()
        self._prefilled: set[str] = set()

    def count_tokens(self, text: str) -> int:
        return len(text)

    def step(self, seqs: list[Seq]) -> list[str | None]:
        new = [s for s in seqs if s.id not in self._prefilled]
        processed = sum(len(s.prompt) + len(s.tokens) for s in new) + len(seqs) - len(new)
        self.seen.update(s.id for s in seqs)
        self._prefilled.update(s.id for s in new)
        self.costs.put(FIXED_S + self.per_token_s * processed)
        assert self.go.wait(HANG_GUARD_S), "the test never let the step go"
        self.go.clear()
        return [sim_token(s.prompt, len(s.tokens)) for s in seqs]

    def release(self, seq_ids: list[str]) -> None:
        self._prefilled.difference_update(seq_ids)


FIXED_S = 0.010


async def drive(generator: TimedGenerator, clock: FakeClock, steps: int | None = None) -> None:
    """Lets steps run (`steps` of them, or until the test puts None), each after moving the
    clock by what it costs."""
    while steps is None or steps > 0:
        cost = await asyncio.to_thread(generator.costs.get, True, HANG_GUARD_S)
        if cost is None:
            return
        clock.advance(cost)
        generator.go.set()
        steps = None if steps is None else steps - 1


def timed_engine(generator: TimedGenerator, clock: FakeClock, **settings: object) -> Engine:
    spec = ModelSpec(name="writer", version="1", generator=lambda d: generator, devices="sim:1")
    config = Config(batch_timeout_ms=600_000, **settings)  # type: ignore[arg-type]
    return Engine(config, models=[spec], clock=clock)


async def refused_at_entry(engine: Engine, prompt: str, request_id: str) -> None:
    async with engine.generate(prompt, Caller(request_id=request_id)):
        pytest.fail("it was admitted")


async def test_a_generation_predicted_to_miss_its_first_token_is_refused_at_arrival():
    generator = TimedGenerator(per_token_s=0.001)
    clock = FakeClock()
    async with timed_engine(generator, clock, first_token_timeout_ms=2000) as engine:
        # Two prefills teach the device its step cost: 10 ms + 1 ms a token.
        driver = asyncio.ensure_future(drive(generator, clock, 2))
        for size in (100, 300):
            assert await run_to_end(engine, "a" * size, f"teach{size}", max_tokens=1) == "a"
        await driver
        # A 1,500-token prompt (1.51 s predicted) is in its step: a 600-token prompt with
        # it would have its first token at 2.11 s, past its 2 s deadline.
        held = asyncio.ensure_future(run_to_end(engine, "L" * 1500, "held", max_tokens=1))
        cost = await asyncio.to_thread(generator.costs.get, True, HANG_GUARD_S)
        with pytest.raises(Overloaded, match=r"predicted in 2\.1 s") as refused:
            await refused_at_entry(engine, "s" * 600, "late")
        assert refused.value.retry_after_s == 1.0
        # Alone it would take 2.51 s: no retry can help, so 504 at once.
        with pytest.raises(DeadlineExceeded, match=r"2500 tokens are predicted to take 2\.5 s"):
            await refused_at_entry(engine, "x" * 2500, "never")
        # One that makes it is taken: 1,500 + 200 tokens, 1.71 s.
        fits = asyncio.ensure_future(run_to_end(engine, "f" * 200, "fits", max_tokens=1))
        await in_line(engine, 1)  # admitted before the clock moves
        clock.advance(cost)
        generator.go.set()
        driver = asyncio.ensure_future(drive(generator, clock, 1))
        assert await held == "L"
        assert await fits == "f"
        await driver
    assert generator.seen == {"teach100", "teach300", "held", "fits"}  # none saw the refused


async def test_a_burst_of_chats_waits_past_the_batch_deadline_within_the_generation_default():
    # 8 prompts of 250 tokens arrive at once on a device that prefills 167 tokens a second:
    # the last first tokens come after 12 s, past --timeout-ms (5 s), which used to bound
    # them (five 504s); the generation's own default deadline holds them all.
    generator = TimedGenerator(per_token_s=0.006)
    clock = FakeClock()
    async with timed_engine(generator, clock) as engine:
        driver = asyncio.ensure_future(drive(generator, clock))

        async def chat(n: int) -> float:
            async with engine.generate(
                Prompt("c" * 250, max_tokens=2), Caller(request_id=f"c{n}")
            ) as gen:
                assert gen.deadline - gen.arrival == 60.0  # --first-token-timeout-ms
                await gen.result()
                first = gen.first_token_at
                assert first is not None
                return first - gen.arrival

        firsts = await asyncio.gather(*(chat(n) for n in range(8)))
        generator.costs.put(None)
        await driver
    assert max(firsts) > 5.0


async def test_a_clients_timeout_is_capped_by_the_first_token_default_not_the_batch_one():
    generator = ChunkedGenerator()
    generator.first_step_go.set()
    settings = {"timeout_ms": 1000, "first_token_timeout_ms": 3000}
    async with chunked_engine(generator, **settings) as engine:
        for asked, given in ((None, 3.0), (2500, 2.5), (9000, 3.0)):
            async with engine.generate(Prompt("ab", timeout_ms=asked)) as gen:
                assert gen.deadline - gen.arrival == pytest.approx(given)
                assert await gen.result() == "ba"


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


def test_the_work_before_a_first_token_counts_each_other_prompt_up_to_its_fair_share():
    new = Prefill("", 1, 50)

    def work(*pending: Prefill) -> int:
        line = PrefillLine()
        for index, prefill in enumerate(pending):
            line.add(index, prefill)
        return work_until_done(line.with_running([]), new)

    # Beside one 5,000-token prompt and one of 20: 50 of the long one, 20 of the short.
    assert work(Prefill("", 1, 5000), Prefill("", 1, 20)) == 120
    assert work() == 50
    # Another tenant of weight 2 gets twice its tenant's work meanwhile, up to what it has.
    assert work(Prefill("b", 2, 5000)) == 150
    assert work(Prefill("b", 2, 30)) == 80
    # Prompts in the bucket that holds 50 (32 to 63) count min(their sum, 50 each): 100
    # for 40 and 60, where exactly it is 90; never short of it.
    assert work(Prefill("", 1, 40), Prefill("", 1, 60)) == 50 + 100


def test_the_line_keeps_its_prefill_by_tenant_as_sequences_join_and_leave():
    line = PrefillLine()
    line.add("a", Prefill("x", 1, 100))
    line.add("b", Prefill("y", 1, 7))
    line.add("a", Prefill("x", 1, 100))  # again: counted once
    line.remove("b")
    line.remove("b")  # gone: nothing to do
    assert len(line) == 1
    ((name, work),) = line.with_running([Prefill("x", 1, 5)]).items()
    assert (name, work.total, work.capped(10)) == ("x", 105, 15)
    line.remove("a")
    assert line.with_running([]) == {}


def test_refusal_is_503_behind_work_and_504_when_the_prompt_alone_is_too_slow():
    refuse_if_late(1.9, 0.5, 2.0, 100)  # on time: nothing raised
    with pytest.raises(Overloaded) as behind:
        refuse_if_late(4.5, 0.5, 2.0, 100)
    assert behind.value.retry_after_s == 3.0
    with pytest.raises(DeadlineExceeded, match="shorten the prompt"):
        refuse_if_late(4.5, 2.5, 2.0, 100)


def test_the_prefill_cost_scales_its_mean_step_only_down_until_it_has_a_line():
    cost = PrefillCost()
    assert cost.step_seconds(10) is None
    cost.observe(0.110, 100)
    assert cost.step_seconds(50) == pytest.approx(0.055)  # errs short: no fixed cost
    assert cost.step_seconds(101) is None  # no grounds to scale up
    cost.observe(0.310, 300)
    assert cost.step_seconds(2000) == pytest.approx(2.010)  # 10 ms + 1 ms a token
