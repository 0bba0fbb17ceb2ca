"""A prompt is never tokenized on the event loop (issue #39, item 2: one 512 KiB prompt,
itself answered 413, stalled the loop long enough for four healthy streams to be failed), and
a prompt too long by its bytes alone is refused before any tokenizer runs."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, ClassVar

import pytest

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Prompt
from batchserve.errors import DuplicateRequestId, InputTooLarge
from batchserve.generation.models import GATHER_S, GATHER_SHARE, INLINE_CHARS
from batchserve.generation.request import Generation
from batchserve.models.generators import Seq
from batchserve.models.specs import ModelSpec

from . import tiny_llama
from .conftest import HANG_GUARD_S
from .test_generation import RecordingGenerator, generate

pytest.importorskip("torch")
pytest.importorskip("transformers")
from batchserve.models.causal_lm import CausalLM

from .test_causal_lm import KV_BYTES, engine_for

LONG = "the cat sat on the mat " * 60
"""Longer than a prompt tokenized on the loop (`INLINE_CHARS`), and within the budget."""


class WatchedTokenizer:
    """The tiny Llama's real tokenizer, recording the thread of every `encode`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.encoded_on: list[threading.Thread] = []

    def encode(self, text: str) -> list[int]:
        self.encoded_on.append(threading.current_thread())
        ids: list[int] = self._inner.encode(text)
        return ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def lm_parts() -> tuple[Any, Any]:
    tok = tiny_llama.tokenizer()
    return tok, tiny_llama.model(len(tok), tok.eos_token_id)


def watched_engine(lm_parts: tuple[Any, Any]) -> tuple[Any, WatchedTokenizer]:
    tok, model = lm_parts
    watched = WatchedTokenizer(tok)
    engine = engine_for(lambda device: CausalLM(model, watched, device, kv_cache_bytes=KV_BYTES))
    return engine, watched


async def test_the_prompt_is_tokenized_off_the_event_loop(lm_parts):
    engine, watched = watched_engine(lm_parts)
    async with engine, engine.generate(Prompt(LONG, max_tokens=3)) as gen:
        await gen.result()
    assert len(LONG) > INLINE_CHARS
    loop_thread = threading.current_thread()
    assert watched.encoded_on  # counted at admission, then encoded again on the device
    assert loop_thread not in watched.encoded_on
    assert gen.prompt_tokens == len(lm_parts[0].encode(LONG))


async def test_a_prompt_too_long_by_its_bytes_is_refused_without_tokenizing(lm_parts):
    engine, watched = watched_engine(lm_parts)
    async with engine:
        (model,) = list(engine._generators)
        longest = model.max_token_bytes
        assert longest == max(len(token) for token in lm_parts[0].get_vocab())
        prompt = "a" * (model.kv_budget * longest + 1)
        with pytest.raises(InputTooLarge, match=f"at least {model.kv_budget + 1} tokens"):
            async with engine.generate(Prompt(prompt, max_tokens=1)):
                pass
        assert watched.encoded_on == []
        # One that may fit by its bytes is tokenized, then judged by its tokens.
        with pytest.raises(InputTooLarge, match="the prompt is"):
            async with engine.generate(Prompt("a" * (model.kv_budget + 5), max_tokens=1)):
                pass
        assert len(watched.encoded_on) == 1


class SlowCounter(RecordingGenerator):
    """Counts a prompt's tokens only once the test lets it: a prompt still being tokenized."""

    counting = threading.Event()
    go = threading.Event()

    def count_tokens(self, text: str) -> int:
        self.counting.set()
        assert self.go.wait(HANG_GUARD_S), "the test never let the count go"
        return len(text)


def slow_counting_engine() -> tuple[Engine, type[SlowCounter]]:
    class Counter(SlowCounter):
        counting = threading.Event()
        go = threading.Event()

    spec = ModelSpec(name="writer", version="1", generator=Counter, devices="sim:1")  # type: ignore[arg-type]
    return Engine(Config(), models=[spec]), Counter


async def test_an_id_admitted_twice_while_tokenizing_is_refused_once():
    engine, counter = slow_counting_engine()
    async with engine:
        first = asyncio.ensure_future(generate(engine, "abc" * 400, request_id="same"))
        assert await asyncio.to_thread(counter.counting.wait, HANG_GUARD_S)
        second = asyncio.ensure_future(generate(engine, "xyz" * 400, request_id="same"))
        await asyncio.sleep(0)  # admitted too: its count waits behind the first's
        counter.go.set()
        assert (await first)[0].startswith("cba")
        with pytest.raises(DuplicateRequestId):
            await second


async def test_a_drain_waits_for_a_prompt_being_tokenized():
    engine, counter = slow_counting_engine()
    async with engine:
        running = asyncio.ensure_future(generate(engine, "drained" * 200))
        assert await asyncio.to_thread(counter.counting.wait, HANG_GUARD_S)
        drained = asyncio.ensure_future(engine.drain())
        for _ in range(100):  # loop passes enough for a drain with nothing in flight
            await asyncio.sleep(0)
        assert not drained.done()
        counter.go.set()
        assert (await running)[0].startswith("deniard")
        await drained


class LongPromptCounter(SlowCounter):
    """Counts a long prompt (on the tokenizer thread) only once the test lets it; a short
    one (on the loop) at once."""

    made: ClassVar[list[LongPromptCounter]] = []

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.made.append(self)

    def count_tokens(self, text: str) -> int:
        return super().count_tokens(text) if len(text) > INLINE_CHARS else len(text)


def gathering_engine(
    clock: FakeClock, devices: str = "sim:1"
) -> tuple[Engine, type[LongPromptCounter]]:
    class Counter(LongPromptCounter):
        counting = threading.Event()
        go = threading.Event()
        made: ClassVar[list[LongPromptCounter]] = []

    spec = ModelSpec(name="writer", version="1", generator=Counter, devices=devices)  # type: ignore[arg-type]
    return Engine(Config(), models=[spec], clock=clock), Counter


async def a_long_prompt_being_counted(
    engine: Engine, counter: type[LongPromptCounter]
) -> asyncio.Future[tuple[str, dict[str, object]]]:
    """A long prompt, admitted and held in its count until the test sets `counter.go`."""
    long = asyncio.ensure_future(generate(engine, "l" * (INLINE_CHARS + 1), max_tokens=2))
    assert await asyncio.to_thread(counter.counting.wait, HANG_GUARD_S)
    return long


async def loop_passes() -> None:
    """Enough passes of the loop for an idle device to step what is in line."""
    for _ in range(100):
        await asyncio.sleep(0)


async def test_an_idle_device_waits_for_a_prompt_still_being_tokenized_beside_the_first():
    # A burst: the long prompt is still being counted when the short one joins the line;
    # the device's first step holds both, not the short one alone first.
    engine, counter = gathering_engine(FakeClock())  # the clock stands still: no bound passes
    async with engine:
        long = await a_long_prompt_being_counted(engine, counter)
        short = asyncio.ensure_future(generate(engine, "short", max_tokens=2))
        await loop_passes()
        (generator,) = counter.made
        assert generator.steps == []
        counter.go.set()
        assert (await short)[0] == "tr"
        assert (await long)[0] == "ll"
        assert len(generator.steps[0]) == 2


async def test_it_waits_no_longer_than_the_gather_bound():
    clock = FakeClock()
    engine, counter = gathering_engine(clock)
    async with engine:
        long = await a_long_prompt_being_counted(engine, counter)
        short = asyncio.ensure_future(generate(engine, "short", max_tokens=2))
        await loop_passes()
        assert not short.done()
        clock.advance(GATHER_S)
        assert (await short)[0] == "tr"  # alone: the long prompt is still being counted
        (generator,) = counter.made
        assert all(len(step) == 1 for step in generator.steps)
        counter.go.set()
        assert (await long)[0] == "ll"


async def test_a_tight_first_token_deadline_shortens_the_wait():
    clock = FakeClock()
    engine, counter = gathering_engine(clock)
    async with engine:
        long = await a_long_prompt_being_counted(engine, counter)
        # 200 ms to its first token: the wait takes a tenth of it, not the whole GATHER_S.
        short = asyncio.ensure_future(generate(engine, "short", max_tokens=2, timeout_ms=200))
        await loop_passes()
        assert not short.done()
        clock.advance(GATHER_SHARE * 0.2)
        assert GATHER_SHARE * 0.2 < GATHER_S
        assert (await short)[0] == "tr"
        counter.go.set()
        assert (await long)[0] == "ll"


async def test_a_burst_is_not_held_back_where_another_device_is_idle_too():
    # Two idle devices: the first prompt starts on one at once, as it did before the wait,
    # leaving the other for the rest of the burst (one device gathering would take it all).
    engine, counter = gathering_engine(FakeClock(), devices="sim:2")
    async with engine:
        long = await a_long_prompt_being_counted(engine, counter)
        short = generate(engine, "short", max_tokens=2)
        assert (await asyncio.wait_for(short, HANG_GUARD_S))[0] == "tr"
        counter.go.set()
        assert (await long)[0] == "ll"


async def test_a_stream_put_back_in_line_does_not_wait_for_new_prompts():
    # A stream already under way (preempted, or handed back from a hung device) goes on at
    # once on an idle device, even while a new prompt is still being tokenized.
    clock = FakeClock()
    engine, counter = gathering_engine(clock)
    async with engine:
        long = await a_long_prompt_being_counted(engine, counter)
        (model,) = list(engine._generators)
        resumed = Generation(
            Seq("resumed", "abc"),
            prompt_tokens=3,
            max_tokens=2,
            stops=(),
            arrival=clock.time(),
            deadline=clock.time() + 60,
            model="writer",
            version="1",
        )
        model.put_back(resumed)
        assert await asyncio.wait_for(resumed.result(), HANG_GUARD_S) == "cb"
        counter.go.set()
        assert (await long)[0] == "ll"
