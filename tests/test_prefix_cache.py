"""Automatic prefix caching (`models/kv_cache.py`, `causal_lm.py`, the scheduler's admission):
the cache's blocks, refcounts and LRU eviction alone, then the tiny Llama through the engine:
greedy text is the same with caching on and off (shared prefixes, preemption, eviction), a
prefix arriving twice at once is computed once, tenants and salts keep their blocks apart, and
the cached tokens reach the OpenAI usage and /metrics.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Caller, Prompt
from batchserve.models.generators import Made, Seq
from batchserve.models.specs import ModelSpec
from batchserve.rules.tenants import Tenant
from batchserve.server import create_app

from . import tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from batchserve.models.causal_lm import CausalLM  # noqa: E402
from batchserve.models.kv_cache import BLOCK, CacheFull, PagedKV, block_keys, root_key  # noqa: E402

PREFIX = " ".join(tiny_llama.CORPUS * 2)
"""A shared "system prompt" of several blocks."""
GREEDY = {"ignore_eos": True}


def cache(rows: int) -> PagedKV:
    """A cache of `rows` rows (one layer of one head of one number each)."""
    return PagedKV(
        torch, layers=1, kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu",
        budget_bytes=rows * 2 * 4,
    )  # fmt: skip


def keys(*ids: int, salt: str = "") -> list[bytes]:
    """Block keys of blocks each filled with one id."""
    return block_keys(root_key("m", salt), [i for i in ids for _ in range(BLOCK)])


def fill(kv: PagedKV, seq_id: str, chain: list[bytes]) -> None:
    """A sequence that computes the blocks of `chain` itself and registers them."""
    kv.grow(seq_id, BLOCK * len(chain))
    kv.seal(seq_id, chain)


def test_a_cached_block_is_evicted_only_when_rows_are_needed_least_recently_used_first():
    kv = cache(4 * BLOCK)
    old, new = keys(1, 2), keys(3)
    fill(kv, "old", old)
    fill(kv, "new", new)
    kv.release("old")  # its last block is idle first, then its first
    kv.release("new")
    assert (kv.free, kv.cached_blocks) == (4 * BLOCK, 3)
    kv.grow("x", BLOCK)  # a free block is left: nothing is evicted
    assert (kv.cached_blocks, kv.evicted) == (3, 0)
    kv.grow("x", BLOCK)  # none free: the least recently used goes, old's last block
    assert kv.evicted == 1
    assert len(kv.match(old).blocks) == 1
    assert len(kv.match(new).blocks) == 1
    kv.grow("x", BLOCK)
    assert len(kv.match(old).blocks) == 0
    assert len(kv.match(new).blocks) == 1


def test_a_block_taken_again_becomes_the_most_recently_used():
    kv = cache(3 * BLOCK)
    first, second = keys(1), keys(2)
    fill(kv, "a", first)
    fill(kv, "b", second)
    kv.release("a")
    kv.release("b")
    kv.adopt("c", kv.match(first).blocks, [])  # first is used again, then let go
    kv.release("c")
    kv.grow("x", 2 * BLOCK)  # one free, then the least recently used: second
    assert len(kv.match(first).blocks) == 1
    assert len(kv.match(second).blocks) == 0


def test_a_shared_block_is_not_freed_or_evicted_while_a_sequence_holds_it():
    kv = cache(2 * BLOCK)
    chain = keys(1)
    fill(kv, "a", chain)
    kv.adopt("b", kv.match(chain).blocks, [])
    assert kv.rows("b") == kv.rows("a")
    assert kv.held == BLOCK
    assert kv.own_rows("a") == 0  # its release would free nothing: b holds the block
    kv.release("a")
    assert kv.free == BLOCK
    with pytest.raises(CacheFull):
        kv.grow("x", BLOCK + 1)  # the held block cannot be evicted
    assert kv.match(chain).blocks
    assert kv.match(chain).idle == 0
    kv.release("b")
    assert kv.match(chain).idle == 1
    assert kv.free == 2 * BLOCK


def test_a_block_being_computed_is_expected_and_keys_differ_by_salt():
    kv = cache(4 * BLOCK)
    chain = keys(1, 2)
    kv.adopt("a", [], chain)
    assert kv.match(chain, "b").expected
    assert not kv.match(chain, "a").expected
    fill(kv, "a", chain)
    assert not kv.match(chain, "b").expected
    assert len(kv.match(chain, "b").blocks) == 2
    assert keys(1, salt="t") != keys(1)
    assert kv.match(keys(1, 2, salt="t")).blocks == []
    kv.release("a")
    assert kv.match(chain).idle == 2


class CountingLM(CausalLM):
    """The real generator, counting the tokens each step processes per sequence."""

    def __init__(self, model: Any, tok: Any, *, kv_bytes: int, caching: bool) -> None:
        super().__init__(model, tok, "cpu", kv_cache_bytes=kv_bytes, prefix_caching=caching)
        self.processed: dict[str, int] = {}

    def step(self, seqs: list[Seq]) -> list[Made]:
        for seq in seqs:  # the scheduler gives a chunked generator every chunk
            self.processed[seq.id] = self.processed.get(seq.id, 0) + (seq.chunk or 0)
        return super().step(seqs)


def engine_of(
    tiny: Any, tok: Any, *, caching: bool = True, kv_bytes: int = 2**20, **settings: Any
) -> tuple[Engine, list[CountingLM]]:
    made: list[CountingLM] = []

    def load(device: str) -> CountingLM:
        made.append(CountingLM(tiny, tok, kv_bytes=kv_bytes, caching=caching))
        return made[-1]

    spec = ModelSpec(name="llm", version="1", generator=load, devices="cpu")
    settings.setdefault("step_tokens", 16)
    settings.setdefault("timeout_ms", 600_000.0)  # a deadline no slow test machine reaches
    return Engine(Config(**settings), models=[spec]), made


def stats(engine: Engine) -> dict[str, Any]:
    assert engine.metrics is not None
    (row,) = engine.metrics.snapshot()["generation"]
    return row  # type: ignore[no-any-return]


async def outputs(engine: Engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy ids, all submitted at once."""

    async def one(prompt: str) -> list[int]:
        async with engine.generate(Prompt(prompt, max_tokens=max_tokens, params=GREEDY)) as gen:
            await gen.result()
            return list(gen.seq.token_ids)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def test_greedy_text_is_the_same_with_caching_on_and_off_across_preemption(tok, tiny):
    prompts = [f"{PREFIX} {word}" for word in ("cat", "bird", "dog", "park", "hand", "mat")]
    prefix_tokens = len(tok.encode(PREFIX))
    assert prefix_tokens > 3 * BLOCK
    answers, rows = {}, {}
    for caching in (True, False):
        # Room for about two sequences: the rest wait, and the running ones are preempted.
        kv_bytes = 512 * 2 * (prefix_tokens + 40)
        engine, made = engine_of(tiny, tok, caching=caching, kv_bytes=kv_bytes)
        async with engine:
            first = await outputs(engine, prompts, 36)  # at once: preempted and evicted
            again = await outputs(engine, prompts[:2], 36)  # later: from the cache
            answers[caching] = (first, again)
            rows[caching] = stats(engine)
            (generator,) = made
        if caching:
            assert rows[caching]["preemptions"] > 0
            assert generator.cache.evicted > 0
            assert rows[caching]["prefix_hits"] >= 2 * (prefix_tokens // BLOCK) * BLOCK
    assert answers[True] == answers[False]
    assert answers[True][0][:2] == answers[True][1]
    assert rows[False]["prefix_hits"] == 0


async def test_a_prefix_arriving_twice_at_once_is_computed_once(tok, tiny):
    prompt = f"{PREFIX} again"
    length = len(tok.encode(prompt))
    for caching in (True, False):
        engine, made = engine_of(tiny, tok, caching=caching)
        async with (
            engine,
            engine.generate(Prompt(prompt, max_tokens=4, params=GREEDY)) as a,
            engine.generate(Prompt(prompt, max_tokens=4, params=GREEDY)) as b,
        ):
            assert await a.result() == await b.result()
        (generator,) = made
        prefill = generator.processed[b.seq.id] - (len(b.seq.tokens) - 1)
        cached = (length - 1) // BLOCK * BLOCK if caching else 0
        assert (b.cached_tokens, prefill) == (cached, length - cached)
        assert generator.processed[a.seq.id] - 3 == length


async def test_tenants_and_salts_keep_their_cached_blocks_apart(tok, tiny):
    one, other = Tenant("one", "paid"), Tenant("other", "paid")
    prompt = f"{PREFIX} tenants"
    hit = (len(tok.encode(prompt)) - 1) // BLOCK * BLOCK

    async def cached(engine: Engine, tenant: Tenant | None, salt: str | None = None) -> int:
        async with engine.generate(
            Prompt(prompt, max_tokens=2, cache_salt=salt), Caller(tenant=tenant)
        ) as gen:
            await gen.result()
            return gen.cached_tokens

    engine, _ = engine_of(tiny, tok)
    async with engine:
        assert await cached(engine, one) == 0
        assert await cached(engine, one) == hit  # the same tenant
        assert await cached(engine, other) == 0  # another: its own blocks
        assert await cached(engine, one, "s") == 0  # a salt: apart from the unsalted
        assert await cached(engine, one, "s") == hit
        assert await cached(engine, other, "s") == 0  # the same salt, another tenant
    shared, _ = engine_of(tiny, tok, prefix_cache_shared=True)
    async with shared:
        assert await cached(shared, one) == 0
        assert await cached(shared, other) == hit  # the operator shares them
        assert await cached(shared, None, "s") == 0


async def test_cached_tokens_reach_the_openai_usage_and_the_metrics(tok, tiny, aiohttp_server):
    engine, _ = engine_of(tiny, tok)
    server = await aiohttp_server(create_app(engine))
    prompt = f"{PREFIX} usage"
    length = len(tok.encode(prompt))
    hit = (length - 1) // BLOCK * BLOCK
    async with openai.AsyncOpenAI(
        base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0
    ) as client:
        first = await client.completions.create(model="llm", prompt=prompt, max_tokens=2)
        again = await client.completions.create(model="llm", prompt=prompt, max_tokens=2)
        stream = await client.completions.create(
            model="llm", prompt=prompt, max_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        streamed = [chunk.usage async for chunk in stream if chunk.usage]
        salted = await client.completions.create(
            model="llm", prompt=prompt, max_tokens=2, extra_body={"cache_salt": "s"}
        )
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            await client.completions.create(
                model="llm", prompt=prompt, max_tokens=2, extra_body={"cache_salt": ""}
            )
        messages: Any = [{"role": "user", "content": prompt}]
        chats = [
            await client.chat.completions.create(model="llm", messages=messages, max_tokens=2)
            for _ in range(2)
        ]
    details = [u.prompt_tokens_details for u in (first.usage, again.usage, *streamed, salted.usage)]
    assert [d.cached_tokens if d else None for d in details] == [0, hit, hit, 0]
    chat_details = [c.usage.prompt_tokens_details for c in chats if c.usage]
    assert [d.cached_tokens if d else None for d in chat_details][1] > 0
    async with aiohttp.ClientSession() as http, http.get(server.make_url("/metrics")) as got:
        text = await got.text()
    queries = 4 * length + 2 * (chats[0].usage.prompt_tokens if chats[0].usage else 0)
    hits = 2 * hit + chat_details[1].cached_tokens  # type: ignore[union-attr]
    assert f'batchserve_prefix_cache_queries_total{{model="llm",version="1"}} {queries}' in text
    assert f'batchserve_prefix_cache_hits_total{{model="llm",version="1"}} {hits}' in text
    assert f'vllm:prefix_cache_queries_total{{model_name="llm"}} {queries}' in text
    assert f'vllm:prefix_cache_hits_total{{model_name="llm"}} {hits}' in text


async def test_the_native_route_takes_a_salt_and_reports_cached_tokens(tok, tiny, aiohttp_server):
    engine, _ = engine_of(tiny, tok)
    server = await aiohttp_server(create_app(engine))
    prompt = f"{PREFIX} native"
    body = {"prompt": prompt, "max_tokens": 2, "cache_salt": "x"}
    async with aiohttp.ClientSession() as http:
        answers = []
        for payload in (body, body, {**body, "cache_salt": "y"}, {**body, "cache_salt": 3}):
            async with http.post(server.make_url("/api/generate"), json=payload) as got:
                answers.append((got.status, await got.json()))
    hit = (len(tok.encode(prompt)) - 1) // BLOCK * BLOCK
    assert [a.get("cached_tokens") for _, a in answers[:3]] == [0, hit, 0]
    assert answers[3][0] == 400
    assert "cache_salt" in str(answers[3][1])


def test_the_device_budget_is_the_whole_cache_and_the_context_bounds_a_sequence(tok, tiny):
    generator = CausalLM(tiny, tok, "cpu", kv_cache_bytes=4 * 2**20)
    per_token = tiny.config.num_hidden_layers * 2 * tiny.config.num_key_value_heads * 16 * 4
    assert generator.kv_budget_tokens == 4 * 2**20 // per_token > 2048
    assert generator.max_seq_tokens == tiny.config.max_position_embeddings == 2048


def test_a_prompt_cached_whole_still_computes_its_last_token_for_logits(tok, tiny):
    generator = CausalLM(tiny, tok, "cpu", kv_cache_bytes=2**20)
    words = PREFIX.split()
    cuts = (" ".join(words[:n]) for n in range(len(words), 0, -1))
    prompt = next(p for p in cuts if len(tok.encode(p)) % BLOCK == 0)
    made = []
    for seq_id in ("a", "b"):
        seq = Seq(seq_id, prompt, params=GREEDY, max_tokens=4)
        cached = generator.attach(seq)
        made.append((cached, generator.step([seq])[0].token_id))
    assert made == [(0, made[0][1]), (len(tok.encode(prompt)) - BLOCK, made[0][1])]


async def test_a_cached_prefix_is_not_predicted_as_prefill_while_it_waits(tok, tiny):
    """The first-token forecast at arrival, and the line's prefill that later arrivals are
    forecast behind, count only what the cache leaves: a shared system prompt already
    cached is not counted again for each request that waits with it."""
    cached = (len(tok.encode(f"{PREFIX} b")) - 1) // BLOCK * BLOCK
    for caching in (True, False):
        engine, _ = engine_of(tiny, tok, caching=caching)
        async with engine:
            await outputs(engine, [f"{PREFIX} a"], 2)
            async with engine.generate(Prompt(f"{PREFIX} b", max_tokens=2, params=GREEDY)) as gen:
                expected = cached if caching else 0
                assert gen.cached_at_arrival == expected
                assert gen.prefill_tokens == gen.prompt_tokens - expected
                await gen.result()
