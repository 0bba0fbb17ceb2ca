"""Log probabilities, `n` choices and `echo` on the OpenAI routes, through the official client
against the tiny Llama (`doors/openai_choices.py`): OpenAI's shapes whole and streamed, the
numbers transformers' own, n choices for one prefill (the metrics' prefill counter), and
every value past its bound refused with 400 before anything starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Caller, Prompt
from batchserve.models.generators import Made, Seq
from batchserve.models.specs import ModelSpec
from batchserve.server import create_app

from . import tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from batchserve.models.causal_lm import CausalLM  # noqa: E402

PROMPT = " ".join(tiny_llama.CORPUS)
MESSAGES: Any = [{"role": "user", "content": "the cat sat"}]


@pytest.fixture
async def served(tok: Any, tiny: Any, aiohttp_server: Any) -> AsyncIterator[Any]:
    """A server of the tiny Llama; (client, base url, engine)."""

    def load(device: str) -> CausalLM:
        return CausalLM(tiny, tok, device, kv_cache_bytes=2**20)

    spec = ModelSpec(name="llm", version="1", generator=load, devices="cpu")
    config = Config(step_tokens=16, timeout_ms=600_000.0, metrics_max_age_ms=0)
    engine = Engine(config, models=[spec])  # /metrics: the counters as they are now
    server = await aiohttp_server(create_app(engine))
    url = str(server.make_url("/v1"))
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        yield client, url, engine


def reference(tiny: Any, ids: list[int]) -> Any:
    with torch.inference_mode():
        return torch.log_softmax(tiny(input_ids=torch.tensor([ids])).logits[0].float(), -1)


async def test_chat_logprobs_have_openais_shape_whole_and_streamed(served, tok, tiny):
    client, _, _ = served
    asked = {
        "logprobs": True,
        "top_logprobs": 3,
        "max_tokens": 4,
        "extra_body": {"ignore_eos": True},
    }
    whole = await client.chat.completions.create(model="llm", messages=MESSAGES, **asked)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 4
    for entry in content:
        raw = bytes(entry.bytes)
        whole_chars = raw.decode(errors="replace") == raw.decode(errors="ignore")
        assert entry.token == raw.decode() if whole_chars else entry.token.startswith("bytes:")
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob  # greedy: the best is chosen
    stream = await client.chat.completions.create(
        model="llm", messages=MESSAGES, stream=True, **asked
    )
    streamed = [e async for chunk in stream for c in chunk.choices if c.logprobs
                for e in c.logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = await client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


async def test_echo_with_max_tokens_0_gives_the_prompts_logprobs_as_evaluators_read_them(
    served, tok, tiny
):
    """lm-evaluation-harness's request: token ids, echo, logprobs, max_tokens 0 or 1."""
    client, _, _ = served
    ids = tok.encode(PROMPT)
    expected = reference(tiny, ids)
    answer = await client.completions.create(
        model="llm", prompt=[ids], max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "length"
    assert choice.text == PROMPT
    assert answer.usage.completion_tokens == 0
    assert answer.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    values = logprobs.token_logprobs[1:]
    want = [float(expected[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert values == pytest.approx(want, abs=1e-4)
    assert "".join(logprobs.tokens) == PROMPT
    assert logprobs.text_offset[-1] == len(PROMPT) - len(logprobs.tokens[-1])
    one = await client.completions.create(
        model="llm", prompt=PROMPT, max_tokens=1, echo=True, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = one.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1  # the prompt's, then the token made
    assert lp.token_logprobs[1:-1] == pytest.approx(want, abs=1e-4)
    assert one.choices[0].text.startswith(PROMPT)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])


async def test_echo_of_a_text_prompt_with_max_tokens_0_is_answered(served, tok):
    """lm-eval's untokenized requests: a text prompt, echo, logprobs, max_tokens 0 (the
    prompt's bytes were once checked as if a token had to be made)."""
    client, _, _ = served
    answer = await client.completions.create(
        model="llm", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0
    )
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text == PROMPT
    assert len(logprobs.token_logprobs) == len(tok.encode(PROMPT))


async def test_n_choices_cost_one_prefill(served, tok):
    client, url, _ = served
    prompt_tokens = len(tok.encode(PROMPT))
    answer = await client.completions.create(
        model="llm", prompt=PROMPT, max_tokens=3, n=4, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in answer.choices) == [0, 1, 2, 3]
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.completion_tokens == 12
    assert len({c.text for c in answer.choices}) > 1  # each choice its own seed
    async with aiohttp.ClientSession() as http, http.get(url.replace("/v1", "/metrics")) as got:
        metrics = await got.text()
    # The first choice's prompt, then one token for each other choice.
    line = 'batchserve_prefill_tokens_total{model="llm",version="1"}'
    assert f"{line} {prompt_tokens + 3}" in metrics
    stream = await client.chat.completions.create(
        model="llm", messages=MESSAGES, n=3, max_tokens=2, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    ended = [c.index async for chunk in stream for c in chunk.choices if c.finish_reason]
    assert sorted(ended) == [0, 1, 2]


class HeldLM(CausalLM):
    """The tiny Llama whose step with sequence "c0" in it waits, once, until `go`."""

    def __init__(self, model: Any, tok: Any, entered: threading.Event, go: threading.Event):
        super().__init__(model, tok, "cpu", kv_cache_bytes=2**20)
        self._entered, self._go = entered, go

    def step(self, seqs: list[Seq]) -> list[Made]:
        if any(seq.id == "c0" for seq in seqs) and not self._go.is_set():
            self._entered.set()
            self._go.wait()
        return super().step(seqs)


async def test_n_choices_run_on_their_first_ones_device_for_one_prefill(tok, tiny):
    """The other choices arrive while the first is in a step on one device and the other
    device is idle: the idle one leaves them for the first's device, where they copy its
    prompt's rows, instead of computing the prompt again."""
    entered, go = threading.Event(), threading.Event()
    spec = ModelSpec(name="llm", version="1", devices="sim:2",
                     generator=lambda device: HeldLM(tiny, tok, entered, go))  # fmt: skip
    engine = Engine(Config(step_tokens=16, timeout_ms=600_000.0), models=[spec])
    params = {"ignore_eos": True}
    async with engine, contextlib.AsyncExitStack() as stack:

        def choice(index: int) -> Any:
            name = f"c0.{index}" if index else "c0"
            asked = Prompt(PROMPT, max_tokens=2, params=params, fork_of="c0" if index else None)
            return stack.enter_async_context(engine.generate(asked, Caller(request_id=name)))

        first = await choice(0)
        await asyncio.to_thread(entered.wait)  # its device is inside its first step
        others = [await choice(index) for index in (1, 2, 3)]
        go.set()
        await asyncio.gather(*(gen.result() for gen in (first, *others)))
        assert engine.metrics is not None
        (row,) = engine.metrics.snapshot()["generation"]
    assert [gen.device for gen in others] == [first.device] * 3
    assert row["prefill_tokens"] == len(tok.encode(PROMPT)) + 3


async def prefilled(url: str) -> int:
    async with aiohttp.ClientSession() as http, http.get(url.replace("/v1", "/metrics")) as got:
        metrics = await got.text()
    line = 'batchserve_prefill_tokens_total{model="llm",version="1"} '
    return int(float(metrics.split(line)[1].split()[0]))


async def test_echoed_choices_share_the_first_ones_prompt_logprobs_and_its_prefill(served, tok):
    """Each choice echoes the prompt's log-probabilities, computed once: the other choices
    fork the first's rows (a sequence computing its prompt's log-probabilities takes none),
    and with max_tokens 0 the choices are one generation written n times."""
    client, url, _ = served
    prompt_tokens = len(tok.encode(PROMPT))
    asked: Any = {"model": "llm", "prompt": PROMPT, "n": 3, "echo": True, "logprobs": 1,
                  "temperature": 1.0, "seed": 3, "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = await client.completions.create(max_tokens=2, **asked)
    assert await prefilled(url) == prompt_tokens + 2  # one token for each other choice
    echoed = [c.logprobs.token_logprobs[:prompt_tokens] for c in whole.choices]
    assert echoed[0][0] is None
    assert None not in echoed[0][1:]
    assert echoed[1] == echoed[0]
    assert echoed[2] == echoed[0]
    assert all(c.text.startswith(PROMPT) for c in whole.choices)
    stream = await client.completions.create(max_tokens=2, stream=True, **asked)
    firsts: dict[int, Any] = {}
    async for chunk in stream:
        for c in chunk.choices:
            firsts.setdefault(c.index, c.logprobs.token_logprobs)
    assert sorted(firsts) == [0, 1, 2]
    assert all(first[:prompt_tokens] == echoed[0] for first in firsts.values())
    before = await prefilled(url)
    alone = await client.completions.create(max_tokens=0, **asked)
    assert await prefilled(url) == before + prompt_tokens
    assert [c.index for c in alone.choices] == [0, 1, 2]
    assert {c.text for c in alone.choices} == {PROMPT}
    assert all(c.logprobs.token_logprobs == echoed[0] for c in alone.choices)
    assert alone.usage.completion_tokens == 0
    streamed: dict[int, str] = {}
    async for chunk in await client.completions.create(max_tokens=0, stream=True, **asked):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == dict.fromkeys((0, 1, 2), PROMPT)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"n": 17}, '"n"'),
        ({"n": 0}, '"n"'),
        ({"logprobs": 21}, '"logprobs"'),
        ({"logprobs": True}, '"logprobs"'),
        ({"best_of": 2}, '"best_of"'),
        ({"echo": "yes"}, '"echo"'),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": True}, "max_tokens"),
        ({"prompt": [10**6]}, "token id"),
        ({"prompt": [[1, 2], [3]]}, '"prompt"'),
    ],
)
async def test_bad_completion_fields_are_refused_before_anything_starts(served, body, named):
    client, _, engine = served
    fields = {"model": "llm", "prompt": "hi", "max_tokens": 2} | body
    with pytest.raises(openai.BadRequestError, match=named):
        await client.post("/completions", body=fields, cast_to=object)
    assert engine.metrics is not None
    (row,) = engine.metrics.snapshot()["generation"]
    assert (row["steps"], row["waiting"], row["running"]) == (0, 0, 0)  # nothing started


@pytest.mark.parametrize(
    ("body", "named"),
    [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
     ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, '"logprobs"'),
     ({"echo": True}, "echo")],
)  # fmt: skip
async def test_bad_chat_fields_are_refused(served, body, named):
    client, _, _ = served
    fields = {"model": "llm", "messages": MESSAGES} | body
    with pytest.raises(openai.BadRequestError, match=named):
        await client.post("/chat/completions", body=fields, cast_to=object)


async def test_the_native_route_refuses_logprobs_it_has_no_place_to_answer(served):
    _, url, _ = served
    body = {"prompt": "hi", "params": {"logprobs": 2}}
    generate = url.replace("/v1", "/api/generate")
    async with aiohttp.ClientSession() as http, http.post(generate, json=body) as got:
        assert got.status == 400
        assert "/v1/completions" in (await got.json())["message"]
