"""Structured output and tool calls (issue #41, items 1, 2 and 4) on the tiny random Llama:
its text is garbage, so every valid answer here is the grammar's doing."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable
from typing import Any, Literal

import aiohttp
import openai
import pytest
from pydantic import BaseModel, Field

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Prompt
from batchserve.errors import InvalidInput, NotReady
from batchserve.generation.grammars import MAX_SLOW, SLOW_COMPILE_S, Grammars
from batchserve.models.grammar import Compiled, Constraint, GrammarError, GrammarSpec, Matcher
from batchserve.models.specs import ModelSpec
from batchserve.server import create_app

from .conftest import HANG_GUARD_S

pytest.importorskip("torch")
pytest.importorskip("xgrammar")
from batchserve.models.causal_lm import CausalLM


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog", "bird"]
    vaccinated: bool
    toys: list[Literal["ball", "rope"]] = Field(max_length=2)


class Weather(BaseModel):
    city: str = Field(max_length=8)
    unit: Literal["c", "f"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": Weather.model_json_schema(),
    },
}
NOTE_TOOL = {
    "type": "function",
    "function": {"name": "take_note", "parameters": Pet.model_json_schema()},
}
CHAT = [{"role": "user", "content": "the cat"}]


def engine_for(tok: Any, model: Any, **settings: Any) -> Engine:
    generator = lambda device: CausalLM(model, tok, device, kv_cache_bytes=2**20)  # noqa: E731
    spec = ModelSpec(name="llm", version="1", generator=generator, devices="cpu")
    return Engine(Config(**settings), models=[spec])


@pytest.fixture
async def served(tok: Any, tiny: Any, aiohttp_server: Any) -> tuple[Any, Engine]:
    engine = engine_for(tok, tiny)
    server = await aiohttp_server(create_app(engine))
    return server, engine


def json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def client_of(server: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="-", max_retries=0)


async def test_every_structured_output_field_holds_the_answer_to_its_grammar(served):
    server, _ = served
    schema = Pet.model_json_schema()
    fields: list[tuple[dict[str, Any], Callable[[str], object]]] = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "pet", "schema": schema, "strict": True}}},
         Pet.model_validate_json),
        ({"response_format": {"type": "json_object"}}, json_object),
        ({"guided_json": schema}, Pet.model_validate_json),
        ({"guided_regex": "[a-c]{2,4}-[0-9]{3}"},
         lambda text: re.fullmatch("[a-c]{2,4}-[0-9]{3}", text) or pytest.fail(text)),
        ({"guided_choice": ["yes", "no", "qu\"oted"]},
         lambda text: text in ("yes", "no", 'qu"oted') or pytest.fail(text)),
        ({"guided_grammar": 'root ::= "a" [0-9]{1,3} "z"'},
         lambda text: re.fullmatch("a[0-9]{1,3}z", text) or pytest.fail(text)),
        ({"structured_outputs": {"json": schema}}, Pet.model_validate_json),
        ({"structured_outputs": {"choice": ["up", "down"]}},
         lambda text: text in ("up", "down") or pytest.fail(text)),
    ]  # fmt: skip
    chat = ("/v1/chat/completions", {"model": "llm", "messages": CHAT})
    routes = [
        (*chat, {}),
        (*chat, {"temperature": 1.0, "seed": 11}),
        ("/v1/completions", {"model": "llm", "prompt": "the cat"}, {}),
        ("/api/generate", {"model": "llm", "prompt": "the cat"}, {}),
    ]
    async with aiohttp.ClientSession() as http:
        for extra, valid in fields:
            for path, body, sampling in routes:
                body = {**body, **extra, "max_tokens": 200}
                if path == "/api/generate":
                    body["params"] = sampling
                else:
                    body |= sampling
                async with http.post(server.make_url(path), json=body) as response:
                    answer = await response.json()
                assert response.status == 200, (path, extra, answer)
                if path == "/api/generate":
                    text, reason = answer["output"], answer["finish_reason"]
                else:
                    choice = answer["choices"][0]
                    reason = choice["finish_reason"]
                    text = choice["message"]["content"] if "message" in choice else choice["text"]
                if reason == "length" and valid is json_object:
                    continue  # an object of any size: it may not end within max_tokens
                assert reason == "stop", (path, extra, sampling, text)
                valid(text)


async def test_a_cut_answer_says_length_and_is_a_start_of_a_valid_one(served):
    server, _ = served
    async with client_of(server) as ai:
        cut = await ai.chat.completions.create(
            model="llm", messages=CHAT, max_tokens=4,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {
                "name": "pet", "schema": Pet.model_json_schema()}},
        )  # fmt: skip
    assert cut.choices[0].finish_reason == "length"
    text = cut.choices[0].message.content or ""
    assert text
    assert '{"name": "'.startswith(text), text  # the schema's start, cut
    async with client_of(server) as ai:
        for stream in (False, True):
            answer = await ai.chat.completions.create(
                model="llm", messages=CHAT, max_tokens=3, tools=[WEATHER_TOOL],  # type: ignore[arg-type,list-item]
                tool_choice="required", stream=stream,
            )  # fmt: skip
            if stream:
                chunks = [chunk.choices[0] async for chunk in answer if chunk.choices]  # type: ignore[union-attr]
                reason = chunks[-1].finish_reason
                said = "".join(c.delta.content or "" for c in chunks)
                calls = [call for c in chunks for call in c.delta.tool_calls or []]
            else:
                (choice,) = answer.choices  # type: ignore[union-attr]
                reason, said = choice.finish_reason, choice.message.content or ""
                calls = choice.message.tool_calls or []
            # Cut inside the call's tags, before its name: neither a call nor text.
            assert (reason, said, calls) == ("length", "", []), stream


async def test_the_openai_client_parses_a_pydantic_model(served):
    server, _ = served
    async with client_of(server) as ai:
        for temperature in (None, 0.8):
            answer = await ai.chat.completions.parse(
                model="llm", messages=CHAT, response_format=Pet,  # type: ignore[arg-type]
                max_tokens=200, temperature=temperature, seed=5,
            )  # fmt: skip
            assert isinstance(answer.choices[0].message.parsed, Pet)


async def test_a_tool_call_round_trip_whole_and_streamed(served):
    server, _ = served
    async with client_of(server) as ai:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            called = await ai.chat.completions.create(
                model="llm", messages=CHAT, tools=[NOTE_TOOL, WEATHER_TOOL],  # type: ignore[list-item]
                tool_choice=choice, max_tokens=200,  # type: ignore[arg-type]
            )  # fmt: skip
            answer = called.choices[0]
            assert answer.finish_reason == "tool_calls"
            assert answer.message.content is None
            (call,) = answer.message.tool_calls or []
            schema = Weather if call.function.name == "get_weather" else Pet  # type: ignore[union-attr]
            schema.model_validate_json(call.function.arguments)  # type: ignore[union-attr]
            if choice != "required":
                assert call.function.name == "get_weather"  # type: ignore[union-attr]

            streamed = await ai.chat.completions.create(
                model="llm", messages=CHAT, tools=[NOTE_TOOL, WEATHER_TOOL],  # type: ignore[list-item]
                tool_choice=choice, max_tokens=200, stream=True,  # type: ignore[arg-type]
            )  # fmt: skip
            chunks = [chunk async for chunk in streamed]
            deltas = [
                c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls
            ]
            assert len(deltas) > 1, "a call streams as its head, then its arguments in pieces"
            head = deltas[0][0]
            arguments = "".join(d[0].function.arguments or "" for d in deltas)  # type: ignore[union-attr]
            assert head.id
            assert head.function.name == call.function.name  # type: ignore[union-attr]
            assert arguments == call.function.arguments  # type: ignore[union-attr]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"

            history = [
                *CHAT,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
            ]
            final = await ai.chat.completions.create(
                model="llm", messages=history, tools=[NOTE_TOOL, WEATHER_TOOL],  # type: ignore[arg-type, list-item]
                tool_choice="none", max_tokens=8,
            )  # fmt: skip
            assert final.choices[0].message.tool_calls is None
            assert final.choices[0].message.content


async def test_bad_tools_and_grammars_are_refused_naming_them_before_any_step(served):
    server, engine = served
    nonsense = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    bad_tool = {"type": "function", "function": {"name": "broken", "parameters": nonsense}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": "{}"}}  # fmt: skip
    cases = [
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                   "function": {"name": "nope"}}},
         "names nope, which is not among"),
        ({"messages": [*CHAT, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
         'messages[1].tool_call_id" "call_9" answers no tool call'),
        ({"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_2", "content": "x"}]},
         'messages[2].tool_call_id'),
        ({"tools": [WEATHER_TOOL, bad_tool], "tool_choice": "required"},
         'tools" does not compile: tool broken: Unsupported type "nonsense"'),
        ({"tools": [bad_tool], "tool_choice": {"type": "function",
                                               "function": {"name": "broken"}}},
         'tools[0].function.parameters" does not compile'),
        ({"tools": [bad_tool]}, "tool broken"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                     "schema": nonsense}}},
         'response_format.json_schema.schema" does not compile: Unsupported type'),
        ({"guided_regex": "("}, '"guided_regex" does not compile'),
        ({"guided_grammar": "root ::= "}, '"guided_grammar" does not compile'),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "give one"),
        ({"response_format": {"type": "json_object"}, "tools": [WEATHER_TOOL]}, "give one"),
        ({"tool_choice": "required"}, 'needs "tools"'),
        ({"response_format": {"type": "xml"}}, '"response_format" must be'),
        ({"structured_outputs": {"yaml": 1}}, "unknown key(s): yaml"),
        ({"guided_choice": []}, '"guided_choice" must be a list'),
        ({"guided_json": "{not json"}, '"guided_json": the schema\'s text is not JSON'),
        ({"response_format": {"type": "json_object"}, "stop": [":"]},
         '"stop" cannot be combined with "response_format"'),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "stop": '"'},
         '"stop" cannot be combined with "tools"'),
    ]  # fmt: skip
    async with aiohttp.ClientSession() as http:
        for extra, message in cases:
            body = {"model": "llm", "messages": CHAT, **extra}
            async with http.post(server.make_url("/v1/chat/completions"), json=body) as response:
                answer = await response.json()
            assert response.status == 400, (extra, answer)
            assert message in answer["error"]["message"], (extra, answer)
    (model,) = engine._generators  # type: ignore[attr-defined]
    assert model.steps == 0, "a refused request reached a device"


async def test_a_constrained_row_leaves_its_batch_mates_answers_alone(tok, tiny):
    engine = engine_for(tok, tiny)
    schema = GrammarSpec("json_schema", json.dumps(Pet.model_json_schema()))

    async def text(prompt: str, constrained: bool) -> str:
        constraint = Constraint(schema, "x") if constrained else None
        asked = Prompt(prompt, max_tokens=24, constraint=constraint)
        async with engine.generate(asked) as gen:
            return await gen.result()

    async with engine:
        alone = await text("the dog", False)
        together = await asyncio.gather(text("the dog", False), text("the cat", True))
    assert together[0] == alone
    assert together[1].startswith('{"name": "')


class Spy:
    """A compile function the test releases: counts calls, blocks until told."""

    def __init__(self) -> None:
        self.calls: list[GrammarSpec] = []
        self.release = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def __call__(self, spec: GrammarSpec) -> Compiled:
        self.calls.append(spec)
        asyncio.run_coroutine_threadsafe(self.release.wait(), self.loop).result()
        if spec.text == "bad":
            raise GrammarError("it is bad")
        return Compiled(None, spec, [])


async def test_grammars_compile_once_are_cached_bounded_and_refused_past_the_bound():
    clock = FakeClock()
    spy = Spy()
    grammars = Grammars(spy, clock, label="llm", cache_size=2, timeout_s=5.0)
    a, b, c, bad = (GrammarSpec("regex", t) for t in ("a", "b", "c", "bad"))
    first_try = asyncio.ensure_future(grammars.compiled(a, "response_format"))
    late = asyncio.ensure_future(grammars.compiled(b, "guided_regex"))  # behind a's compile
    await asyncio.sleep(0)
    clock.advance(5.0)
    with pytest.raises(InvalidInput, match='"response_format" was not compiled within 5000 ms'):
        await first_try
    with pytest.raises(InvalidInput, match='"guided_regex" was not compiled within 5000 ms'):
        await late
    # a's compile runs on: later requests for it wait for that one compile
    waiting = [asyncio.ensure_future(grammars.compiled(a, "f")) for _ in range(3)]
    await asyncio.sleep(0)
    spy.release.set()
    first, *others = await asyncio.gather(*waiting)
    assert all(other is first for other in others)
    await grammars.compiled(b, "f")  # b's compile ran on: its outcome was kept
    assert spy.calls == [a, b]
    with pytest.raises(InvalidInput, match='"x" does not compile: it is bad'):
        await grammars.compiled(bad, "x")
    with pytest.raises(InvalidInput, match='"y" does not compile: it is bad'):
        await grammars.compiled(bad, "y")  # a failure is cached too
    await grammars.compiled(c, "f")
    assert len(grammars) == 2  # bounded: a and b went out first
    await grammars.compiled(a, "f")
    assert spy.calls == [a, b, bad, c, a]
    grammars.close()


async def test_a_slow_compile_holds_up_no_other_and_few_hold_threads():
    """One client's pathological grammar (its compile never ends here) does not hold up the
    grammars asked for beside it; at most `MAX_SLOW` slow compiles hold threads, then the
    next waits, and is dropped once nobody waits for it."""
    clock = FakeClock()
    release = threading.Event()

    def compile_one(spec: GrammarSpec) -> Compiled:
        if spec.text.startswith("slow"):
            release.wait(HANG_GUARD_S)
        return Compiled(None, spec, [])

    grammars = Grammars(compile_one, clock, label="llm", cache_size=8, timeout_s=5.0)

    def ask(text: str) -> asyncio.Future[Compiled]:
        return asyncio.ensure_future(grammars.compiled(GrammarSpec("regex", text), "f"))

    try:
        slow = [ask("slow0")]
        fast = ask("fast")  # queued behind slow0, well within its own bound
        await asyncio.sleep(0)
        clock.advance(SLOW_COMPILE_S)  # slow0 is slow: fast starts beside it
        assert await asyncio.wait_for(fast, HANG_GUARD_S)
        for n in range(1, MAX_SLOW):
            slow.append(ask(f"slow{n}"))
            await asyncio.sleep(0)
            clock.advance(SLOW_COMPILE_S)
        given_up = ask("given-up")  # every thread is held by a slow compile: it waits
        await asyncio.sleep(0)
        assert list(grammars._queued) == [GrammarSpec("regex", "given-up")]
        clock.advance(5.0)  # past every request's bound
        for request in [*slow, given_up]:
            with pytest.raises(InvalidInput, match="was not compiled within 5000 ms"):
                await request
        assert not grammars._queued  # nobody waits for it any more: dropped, not compiled
        closing = ask("closing")
        await asyncio.sleep(0)
        grammars.close()
        with pytest.raises(NotReady, match="shutting down"):
            await closing
        with pytest.raises(NotReady, match="shutting down"):  # and what comes after
            await grammars.compiled(GrammarSpec("regex", "after"), "f")
    finally:
        release.set()
        grammars.close()


def allowed_next(matcher: Matcher, vocab: int) -> list[int]:
    """The token ids `matcher` allows next, as xgrammar's own kernel masks them."""
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill(bitmask, 0)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return torch.nonzero(logits[0] == 0).flatten().tolist()


def test_a_length_bounded_string_holds_no_control_character(tok):
    """xgrammar 0.2 lets a string with maxLength hold control characters (JSON forbids
    them, and pydantic refuses them): the rule is rewritten."""
    from batchserve.models.grammar import GrammarCompiler

    compiler = GrammarCompiler(tok, len(tok), {tok.eos_token_id})
    matcher = compiler.compile(GrammarSpec("json_schema", json.dumps(Weather.model_json_schema())))
    step = matcher.matcher(tok.encode('{"city": "a'))
    allowed = [tok.decode([i]) for i in allowed_next(step, len(tok))]
    assert allowed
    assert not [t for t in allowed if t and ord(t[0]) < 0x20]


@pytest.mark.parametrize(
    ("bounds", "lengths"),
    [({"maxLength": 5}, range(6)), ({"minLength": 2, "maxLength": 4}, range(2, 5))],
)
def test_a_length_bounded_string_is_a_chain_of_rules_holding_the_same_strings(bounds, lengths):
    """xgrammar fills a mask slowly inside its bounded repetition (`c{0, 24}`): the rule is
    written as a chain of rules, which must hold exactly the strings the bounds allow."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from batchserve.models.grammar import _json_grammar

    tag = {"type": "string", "maxLength": 3}  # shares the name's chain
    schema = {"type": "object", "properties": {"name": {"type": "string", **bounds}, "tag": tag},
              "required": ["name", "tag"], "additionalProperties": False}  # fmt: skip
    grammar = _json_grammar(xgr, json.dumps(schema))
    assert not re.search(r"characters\{\d+, \d+\}", str(grammar)), str(grammar)
    for length in range(8):
        text = '{"name": "' + "é" * length + '", "tag": "abc"}'
        assert _is_grammar_accept_string(grammar, text) is (length in lengths), text
    assert not _is_grammar_accept_string(grammar, '{"name": "ab", "tag": "abcd"}')
    assert not _is_grammar_accept_string(grammar, '{"name": "a\tb", "tag": ""}')  # control


def test_strings_of_the_same_characters_share_a_chain_of_small_bounds_and_one_character():
    """Each link costs the compile a few ms: strings of the same characters share links.
    A string of a longer rule, or past MAX_CHAINED, keeps xgrammar's repetition."""
    from batchserve.models.grammar import MAX_CHAINED, _chained

    text = f"""root ::= ((s v t u))
s ::= (("\\"" c{{1, 2}} "\\""))
v ::= (("\\"" d{{0, 1}} "\\""))
t ::= (("\\"" w{{0, 2}} "\\""))
u ::= (("\\"" c{{0, {MAX_CHAINED + 1}}} "\\""))
c ::= (([a-z]))
d ::= (([a-z]))
w ::= (("ab"))
"""
    assert _chained(text).splitlines() == [
        "root ::= ((s v t u))",
        's ::= (("\\"" c c_end1))',
        'v ::= (("\\"" c_end1))',
        *text.splitlines()[3:],
        'c_end0 ::= (("\\""))',
        'c_end1 ::= (("\\"") | (c c_end0))',
    ]


async def test_a_pydantic_ai_agent_calls_its_tool_and_answers_in_its_schema(served):
    """pydantic-ai asks for its output as a call of its own `final_result` tool, with
    tool_choice required: every answer is a valid call; the agent runs its tool, sends the
    result back as a tool message, and ends on a valid output."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    server, _ = served
    async with client_of(server) as ai:
        model = OpenAIChatModel("llm", provider=OpenAIProvider(openai_client=ai))
        agent = Agent(model, output_type=Weather, model_settings={"max_tokens": 200})
        looked_up: list[str] = []

        async def once(ctx: Any, tool: Any) -> Any:
            """A random model would call it for ever: offered until it has run."""
            return None if looked_up else tool

        @agent.tool_plain(prepare=once)
        def look_up(city: Literal["paris", "rome"]) -> str:
            """The weather in a city."""
            looked_up.append(city)
            return "sunny"

        result = await agent.run("the cat", usage_limits=UsageLimits(request_limit=6))
    assert isinstance(result.output, Weather)
    returns = [
        part
        for message in result.all_messages()
        for part in getattr(message, "parts", [])
        if isinstance(part, ToolReturnPart)
    ]
    assert looked_up in (["paris"], ["rome"])
    assert [part.tool_name for part in returns] == ["look_up", "final_result"]


@pytest.mark.parametrize("vocab", [49_152, 1_000])
def test_the_cpu_mask_blocks_what_xgrammars_kernel_blocks(vocab):
    """`mask_on_cpu` (a byte at a time) against xgrammar's own kernel: the same -inf, the
    same kept values, rows without a grammar untouched, a vocabulary not a multiple of 32."""
    import torch
    import xgrammar as xgr

    from batchserve.models.grammar import mask_on_cpu

    draw = torch.Generator().manual_seed(7)
    bitmask = xgr.allocate_token_bitmask(6, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=draw))
    bitmask[1, 3:] = 0  # a row that allows almost nothing
    logits = torch.randn(6, vocab, generator=draw)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 4]):
        ours, theirs = logits.clone(), logits.clone()
        mask_on_cpu(torch, ours, bitmask, rows)
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
        assert torch.equal(ours, theirs)
        assert torch.isinf(ours[1]).sum() >= vocab - 3 * 32
        untouched = [row for row in range(6) if row not in rows]
        assert torch.equal(ours[untouched], logits[untouched])


async def test_top_logprobs_under_a_grammar_list_only_tokens_it_allows(served):
    """A forbidden token's log-probability is -inf, which JSON cannot hold (it was written
    as null): the alternatives are the tokens the grammar allows, however few."""
    server, _ = served
    body = {"model": "llm", "messages": CHAT, "max_tokens": 4, "logprobs": True,
            "top_logprobs": 20, "guided_choice": ["cat", "dog"]}  # fmt: skip
    url = server.make_url("/v1/chat/completions")
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        answer = await response.json()
    assert response.status == 200, answer
    assert answer["choices"][0]["message"]["content"] in ("cat", "dog")
    content = answer["choices"][0]["logprobs"]["content"]
    first = content[0]["top_logprobs"]
    assert 0 < len(first) < 20  # only beginnings of "cat" and "dog"
    assert all(t["token"] and ("cat".startswith(t["token"]) or "dog".startswith(t["token"]))
               for t in first)  # fmt: skip
    assert all(isinstance(t["logprob"], float) for e in content for t in e["top_logprobs"])


ALTERNATING = (
    "{% for m in messages %}{% if not loop.first and m['role'] == messages[loop.index0 - 1]"
    "['role'] %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A chat template that refuses two turns of one role in a row, as Mistral's and Gemma's do."""


async def test_a_template_that_refuses_the_chat_gets_400_and_parallel_results_share_a_turn(
    served, tok, monkeypatch
):
    server, _ = served
    monkeypatch.setattr(tok, "chat_template", ALTERNATING, raising=False)
    calls = [{"id": f"call_{n}", "type": "function",
              "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
             for n, city in enumerate(["Paris", "Oslo"])]  # fmt: skip
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in calls]
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": calls}, *results]
    url = server.make_url("/v1/chat/completions")
    async with aiohttp.ClientSession() as http:
        twice = {"model": "llm", "messages": [*CHAT, *CHAT], "max_tokens": 2}
        async with http.post(url, json=twice) as response:
            refused = await response.json()
        assert response.status == 400, refused
        assert refused["error"]["message"] == (
            "the model's chat template refused these messages: roles must alternate"
        )
        # Two parallel calls' results: one user turn, so the template takes the chat.
        answered = {"model": "llm", "messages": history, "tools": [WEATHER_TOOL],
                    "max_tokens": 2}  # fmt: skip
        async with http.post(url, json=answered) as response:
            assert response.status == 200, await response.text()


def test_a_template_with_a_tools_section_is_given_the_tools_and_the_calls_as_objects(
    tok, monkeypatch
):
    from batchserve.models.chat_tools import templated_chat

    monkeypatch.setattr(tok, "chat_template", TOOLS_TEMPLATE, raising=False)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}]
    text = templated_chat(tok, history, [WEATHER_TOOL])
    assert text.startswith('<tools>[{"type": "function", "function": {"name": "get_weather"')
    assert "<|assistant|>call get_weather Oslo" in text  # the arguments as an object
    assert text.endswith("<|assistant|>")
    assert "<tool_call>" not in text  # the template's own format, not the fallback's


TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% for c in m.get('tool_calls') or [] %}"
    "call {{ c['function']['name'] }} {{ c['function']['arguments']['city'] }}{% endfor %}"
    "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A chat template with a tools section (as Qwen's and Hermes' have)."""


def test_parallel_tool_calls_false_ends_an_auto_answer_after_its_first_call(tok):
    from batchserve.models.grammar import GrammarCompiler

    compiler = GrammarCompiler(tok, len(tok), {tok.eos_token_id})
    tools = json.dumps([{"name": "get_weather", "parameters": Weather.model_json_schema()}])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
    made = tok.encode("Let me look. " + call + "\n</tool_call>", add_special_tokens=False)

    def after_the_call(kind: Literal["tool_auto", "tool_auto_one"]) -> set[int]:
        return set(allowed_next(compiler.compile(GrammarSpec(kind, tools)).matcher(made), len(tok)))

    assert after_the_call("tool_auto_one") == {tok.eos_token_id}
    after_one_of_many = after_the_call("tool_auto")
    assert tok.eos_token_id in after_one_of_many
    assert tok.encode("<", add_special_tokens=False)[0] in after_one_of_many  # another call


async def test_a_preempted_constrained_sequence_replays_its_grammar(tok, tiny):
    """A preempted sequence is recomputed from its prompt and the tokens it made, and its
    matcher replayed from them: its answer is the one it makes alone."""
    spec = GrammarSpec("json_schema", json.dumps(Pet.model_json_schema()))
    prompts = [" ".join([word] * 40) for word in ("cat", "bird", "dog", "park", "hand", "mat")]
    longest = max(len(tok.encode(p)) for p in prompts)
    most = 160  # room for the whole answer

    def engine_of(kv_bytes: int) -> Engine:
        generator = lambda device: CausalLM(tiny, tok, device, kv_cache_bytes=kv_bytes)  # noqa: E731
        spec = ModelSpec(name="llm", version="1", generator=generator, devices="cpu")
        return Engine(Config(step_tokens=16, timeout_ms=600_000.0), models=[spec])

    async def answer(engine: Engine, prompt: str) -> str:
        asked = Prompt(prompt, max_tokens=most, constraint=Constraint(spec, "x"))
        async with engine.generate(asked) as gen:
            return await gen.result()

    async with engine_of(2**20) as roomy:
        alone = [await answer(roomy, p) for p in prompts]
    async with engine_of(512 * 2 * (longest + most)) as tight:  # room for about two
        together = await asyncio.gather(*(answer(tight, p) for p in prompts))
        assert tight.metrics is not None
        (row,) = tight.metrics.snapshot()["generation"]
    assert row["preemptions"] > 0
    assert list(together) == alone
    assert all(Pet.model_validate_json(text) for text in alone)


def test_a_call_cut_anywhere_keeps_only_the_start_of_its_arguments():
    """Read in pieces and cut by `max_tokens` at every place: the call's arguments are the
    start of its JSON (never the closing tags' start), and the tags never become text."""
    from batchserve.doors.tool_calls import ToolStream

    arguments = '{"city": "Oslo", "unit": "c"}'
    written = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    for end in range(len(written) + 1):
        stream = ToolStream()
        deltas = [d for piece in range(0, end, 3) for d in stream.feed(written[piece:end][:3])]
        deltas += stream.flush(cut=True)
        said = "".join(d.get("content", "") for d in deltas)
        got = "".join(call["function"].get("arguments", "") for d in deltas
                      for call in d.get("tool_calls", []))  # fmt: skip
        assert said == "", end
        assert arguments.startswith(got), (end, got)
        if end == len(written):
            assert got == arguments


def test_auto_text_and_two_calls_read_in_pieces_are_content_and_two_tool_calls():
    from batchserve.doors.tool_calls import ToolStream

    calls = [("get_weather", '{"city": "Oslo", "unit": "c"}'), ("take_note", '{"name": "x<"}')]
    written = "I will look <b>twice</b>. " + "".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
        for name, args in calls
    )
    for size in (1, 3, 7, len(written)):
        stream = ToolStream()
        deltas = [
            d for at in range(0, len(written), size) for d in stream.feed(written[at : at + size])
        ]
        deltas += stream.flush()
        assert "".join(d.get("content", "") for d in deltas) == "I will look <b>twice</b>. "
        read = [(c["function"]["name"], c["function"]["arguments"]) for c in stream.calls]
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        arguments = ["".join(c["function"].get("arguments", "") for c in streamed
                             if c["index"] == index) for index in range(2)]  # fmt: skip
        assert [name for name, _ in read] == [name for name, _ in calls]
        assert arguments == [args for _, args in calls], size
