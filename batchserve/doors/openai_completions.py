"""The OpenAI-shaped generation doors: `POST /v1/completions` and `/v1/chat/completions`.

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="default", prompt="Hello", max_tokens=16)
    for chunk in client.chat.completions.create(model="default", messages=[...], stream=True):
        print(chunk.choices[0].delta.content or "", end="")

Both run one generation through the engine, exactly as `/api/generate` does; a chat's
messages become one prompt by the generator's `chat_prompt(messages)` when it has one, else
by a plain role-tagged template. `temperature`, `top_p`, `seed` and vLLM's `top_k`,
`ignore_eos` and `min_tokens` go to the generator as params; vLLM's `cache_salt` keeps the
request's cached prefixes to requests with the same salt, and `usage.prompt_tokens_details.
cached_tokens` says how many prompt tokens came from the cache. OpenAI's other fields are taken
where their value changes nothing here (`tools: []`, `store`, ...) and refused (400,
naming the field) where it would change the answer (`openai_fields.py`), never ignored.
`n`, log probabilities and `echo` are `openai_choices.py`'s; a completion's prompt may be
token ids (a list of ints, or a list of one such list), as evaluators send it.
Errors carry OpenAI's body shape, which its clients raise as typed exceptions; a failure
mid-stream is a `data: {"error": ...}` chunk, which the official client raises.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any, NamedTuple, cast

from aiohttp import web

from ..config import Config
from ..engine.requests import Prompt
from ..errors import BatchserveError, InvalidInput
from ..generation.request import Generation
from ..models.logprobs import TokenLogprob
from ..rules.sampling_params import LOGPROBS, MAX_LOGPROBS, SCHEMAS
from .face import Generating, Reception
from .generate_api import SSE, STOP, max_tokens_schema
from .generation_answer import data_event
from .openai_choices import (
    MAX_N,
    Choices,
    Copies,
    Event,
    all_choices,
    answer_choices,
    chat_logprobs,
    choice_params,
    completion_logprobs,
    prompt_text,
    read_choices,
)
from .openai_fields import check_fields, neutral_schemas, sampling_params
from .openai_tools import CHAT_SCHEMAS, MESSAGE, ChatShape, one_constraint
from .openapi import REQUEST_ID, TIMEOUT, Answer, ModelName, Operation, errors
from .structured import STRUCTURED_SCHEMAS, constraint_of
from .tool_calls import Tools, read_messages, read_tools
from .wire import CACHE_SALT_SCHEMA, cache_salt_of, openai_error, read_call, timeout_ms_of


class Completion(NamedTuple):
    """A completions or chat body, read: what the engine needs, and how to answer."""

    model: str
    prompt: Prompt
    """The prompt; for a chat, its messages in the generator's template once read."""
    messages: list[dict[str, Any]] | None
    stream: bool
    include_usage: bool
    choices: Choices
    tools: Tools


class OpenAICompletionsApi:
    def __init__(self, reception: Reception, generation: Generating) -> None:
        self._reception = reception
        self._generation = generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        route = "chat_completions" if chat else "completions"
        generation = self._generation

        def parse(payload: dict[str, Any], request: web.Request) -> Completion:
            """The body, a chat's messages made one prompt here, so that a refusal of
            either (an unknown model) is recorded like any other bad body."""
            body = _read_completion(payload, request, chat=chat)
            if body.messages is None:
                return body
            text = generation.chat_prompt(body.model, body.messages, body.tools.listed)
            return body._replace(prompt=replace(body.prompt, text=text))

        like = CHAT_LIKE if chat else COMPLETION_LIKE
        call = await read_call(request, self._reception, route, parse, like=like, openai_shape=True)
        if isinstance(call, web.Response):
            return call
        body = call.body
        answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{call.request_id}"
        shape = _Shape(
            chat, answer_id, body.model, body.choices, body.include_usage, body.tools.reads_calls
        )
        caller, asked = call.caller, body.prompt

        def start(index: int) -> contextlib.AbstractAsyncContextManager[Generation]:
            """Choice `index`; the others copy the first's prompt rows (one prefill)."""
            params = choice_params(dict(asked.params or {}), body.choices, index, asked.prompt_ids)
            if not index:
                return generation.generate(replace(asked, params=params), caller)
            return generation.generate(
                replace(asked, params=params, fork_of=call.request_id),
                replace(caller, request_id=f"{call.request_id}.{index}"),
            )

        n, echo = body.choices.n, body.choices.echo
        if asked.max_tokens == 0 and n > 1:  # echo alone: n copies of one generation
            return await answer_choices(request, all_choices(start, 1), call.request_id,
                                        stream=body.stream, shape=Copies(shape, n))  # fmt: skip
        return await answer_choices(
            request,
            all_choices(start, n),
            call.request_id,
            stream=body.stream,
            shape=shape,
            first_leads=echo and n > 1,
        )


class _Shape:
    """How one answer is written: a completion or a chat completion, whole or in chunks,
    with its choices and, where asked, their log-probabilities."""

    def __init__(
        self,
        chat: bool,
        answer_id: str,
        model: str,
        choices: Choices,
        include_usage: bool,
        reads_calls: bool = False,
    ) -> None:
        self._chat = chat
        self._choices = choices
        self._include_usage = include_usage
        self._calls = [ChatShape(reads_calls) for _ in range(choices.n)]
        """Each choice's message: its text, or its tool calls read out of it."""
        self._head = {
            "id": answer_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self._started: set[int] = set()
        self._sent = [0] * choices.n
        """Each choice's log-probabilities streamed so far."""
        self._offset = [0] * choices.n
        """Each choice's text streamed so far (where its next token's text starts)."""

    def whole(self, gens: list[Generation], outputs: list[str]) -> dict[str, Any]:
        choices = []
        for index, (gen, output) in enumerate(zip(gens, outputs, strict=True)):
            choice: dict[str, Any] = {"index": index, "finish_reason": gen.finish_reason}
            if self._chat:
                choice |= self._calls[index].whole(output, gen.finish_reason)
                choice["logprobs"] = self._chat_logprobs(gen.logprobs)
            else:
                text, logprobs = self._completion(index, gens, output, gen.logprobs)
                choice |= {"text": text, "logprobs": logprobs}
            choices.append(choice)
        return self._head | {"choices": choices, "usage": _usage(gens)}

    def event(self, event: Event, gens: list[Generation]) -> bytes:
        """One choice's piece, or (its text None) its ending, as chunks."""
        index, gen = event.choice, gens[event.choice]
        ended = event.text is None
        if self._chat:
            return self._chat_event(event, gen, ended)
        entries = self._entries(event, gen, ended)
        first = index not in self._started
        self._started.add(index)
        text, logprobs = self._completion(index, gens, event.text or "", entries, first)
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": gen.finish_reason if ended else None,
            "text": text,
            "logprobs": logprobs,
        }
        return data_event(self._chunk_head() | {"choices": [choice]})

    def _chat_event(self, event: Event, gen: Generation, ended: bool) -> bytes:
        """A chat choice's deltas: its text, or its tool calls as they are read (text held
        until it is known not to open a call sends nothing yet, its log-probabilities going
        with the next delta); at its end, what was held, then the finish reason."""
        index, calls = event.choice, self._calls[event.choice]
        cut = gen.finish_reason == "length"
        deltas = calls.flush(cut=cut) if ended else calls.feed(event.text or "")
        if ended:
            deltas.append({})
        chunks = []
        for number, delta in enumerate(deltas):
            last = ended and number == len(deltas) - 1
            if index not in self._started:
                delta["role"] = "assistant"
                self._started.add(index)
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": calls.finish_reason(gen.finish_reason) if last else None,
                "delta": delta,
            }
            if self._choices.logprobs is not None:
                choice["logprobs"] = self._chat_logprobs(self._entries(event, gen, ended))
            chunks.append(data_event(self._chunk_head() | {"choices": [choice]}))
        return b"".join(chunks)

    def _entries(self, event: Event, gen: Generation, ended: bool) -> list[TokenLogprob]:
        """The choice's log-probabilities not yet sent, up to this event's tokens."""
        index = event.choice
        entries = gen.logprobs[self._sent[index] : None if ended else event.tokens]
        self._sent[index] += len(entries)
        return entries

    def closing(self, gens: list[Generation]) -> bytes:
        """After every choice's ending: the usage chunk, where asked."""
        if not self._include_usage:
            return b""
        return data_event(self._chunk_head() | {"choices": [], "usage": _usage(gens)})

    def failure(self, error: BatchserveError) -> bytes:
        return data_event({"error": openai_error(error)})

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        return None if self._choices.logprobs is None else chat_logprobs(entries)

    def _completion(
        self,
        index: int,
        gens: list[Generation],
        text: str,
        entries: list[TokenLogprob],
        first: bool = True,
    ) -> tuple[str, dict[str, Any] | None]:
        """A completion choice's text (the prompt first, where echoed) and log-probabilities
        (the echoed prompt's first, as the first choice computed them), with each token's
        offset in the choice's text."""
        echo = self._choices.echo and first
        shown: list[TokenLogprob | None] = list(entries)
        if echo:
            text = prompt_text(gens[0]) + text
            shown = [*(gens[0].prompt_logprobs or ()), *shown]
        offset = self._offset[index]
        self._offset[index] += len(text)
        if self._choices.logprobs is None:
            return text, None
        return text, completion_logprobs(shown, offset)

    def _chunk_head(self) -> dict[str, Any]:
        if self._chat:
            return self._head | {"object": "chat.completion.chunk"}
        return self._head


def read_line(payload: dict[str, Any], *, chat: bool) -> Completion:
    """A Batch API line's body, read as this door reads one (a line has no headers)."""
    return _read_completion(payload, cast(web.Request, _NO_HEADERS), chat=chat)


def whole_answer(
    gen: Generation, output: str, *, answer_id: str, asked: Completion
) -> dict[str, Any]:
    """The answer this door gives for `gen`, whole: a Batch API line's output (one choice)."""
    chat = asked.messages is not None
    shape = _Shape(chat, answer_id, gen.model, asked.choices, False, asked.tools.reads_calls)
    return shape.whole([gen], [output])


class _NoHeaders:
    headers: dict[str, str] = {}  # noqa: RUF012 (read only)


_NO_HEADERS = _NoHeaders()


def _usage(gens: list[Generation]) -> dict[str, Any]:
    """The prompt once (its choices share it), every choice's tokens."""
    first = gens[0]
    made = sum(len(gen.seq.tokens) for gen in gens)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": made,
        "total_tokens": first.prompt_tokens + made,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def _read_completion(payload: dict[str, Any], request: web.Request, *, chat: bool) -> Completion:
    check_fields(payload, chat=chat)
    model = payload.get("model")
    if not isinstance(model, str):
        raise InvalidInput('the body needs a string field "model"')
    messages = read_messages(payload.get("messages")) if chat else None
    tools = read_tools(payload) if chat else Tools(None, None)
    prompt, prompt_ids = ("", None) if chat else _prompt(payload.get("prompt"))
    max_tokens = payload.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = payload.get("max_tokens")
    stream = payload.get("stream") or False
    options = payload.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise InvalidInput('"stream" must be true or false, "stream_options" an object')
    asked = Prompt(
        prompt,
        model=model,
        max_tokens=max_tokens,
        stop=payload.get("stop"),
        params=sampling_params(payload),
        timeout_ms=timeout_ms_of(None, request),
        cache_salt=cache_salt_of(payload),
        prompt_ids=prompt_ids,
        constraint=one_constraint(constraint_of(payload), tools.constraint),
    )
    return Completion(
        model,
        asked,
        messages,
        stream,
        options.get("include_usage") is True,
        read_choices(payload, chat=chat),
        tools,
    )


def _prompt(given: object) -> tuple[str, list[int] | None]:
    """The prompt's text, or its token ids: a string or a list of ints, or a list of one
    of either (what evaluators send, one prompt a request)."""
    if isinstance(given, list) and len(given) == 1 and isinstance(given[0], str | list):
        given = given[0]
    if isinstance(given, str):
        return given, None
    if isinstance(given, list) and given and all(type(i) is int for i in given):
        return "", given
    raise InvalidInput(
        '"prompt" must be a string or a non-empty list of token ids (or a list of one of either)'
    )


COMPLETION_LIKE = '{"model": "...", "prompt": "..."}'
CHAT_LIKE = '{"model": "...", "messages": [{"role": "user", "content": "..."}]}'
"""What the bodies of /v1/completions and /v1/chat/completions look like, for one that
does not."""
_CHOICE = {"type": "object", "required": ["index", "finish_reason"]}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
        }
    },
    "additionalProperties": {"type": "integer", "minimum": 0},
}


def completion_operation(config: Config, *, chat: bool) -> Operation:
    """POST /v1/completions (or, `chat`, /v1/chat/completions) as the OpenAPI document
    describes it: the fields `_read_completion` reads, and the neutral ones at the value
    they take (`openai_fields.py`); any other field is 400."""
    top = {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS}
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    text = (
        {
            "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
            "max_completion_tokens": max_tokens_schema(config),
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": top | {"description": "needs logprobs: true"},
            **CHAT_SCHEMAS,
        }
        if chat
        else {
            "prompt": {
                "anyOf": [
                    {"type": "string"},
                    ids,
                    {"type": "array", "minItems": 1, "maxItems": 1,
                     "items": {"anyOf": [{"type": "string"}, ids]}},
                ]
            },
            "logprobs": top,
            "echo": {"type": ["boolean", "null"], "description": "the prompt before the"
                     " completion (with logprobs, its tokens' too; max_tokens 0 with it)"},
        }
    )  # fmt: skip
    name = "ChatCompletion" if chat else "Completion"
    body = {
        "title": f"{name}Request",
        "type": "object",
        "required": ["model", "messages" if chat else "prompt"],
        "additionalProperties": False,
        "properties": {
            "model": ModelName("generation"),
            **text,
            "max_tokens": max_tokens_schema(config)
            | ({} if chat else {"minimum": 0, "description": "0 only with echo and logprobs"}),
            "stop": STOP,
            "cache_salt": CACHE_SALT_SCHEMA,
            "stream": {"type": ["boolean", "null"]},
            "stream_options": {
                "type": ["object", "null"],
                "properties": {"include_usage": {"type": "boolean"}},
            },
            "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N},
            **{name: schema for name, schema in SCHEMAS.items() if name not in LOGPROBS},
            **STRUCTURED_SCHEMAS,
            **neutral_schemas(chat=chat),
        },
    }
    answer = {
        "title": name,
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion" if chat else "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "minItems": 1, "maxItems": MAX_N, "items": _CHOICE},
            "usage": _USAGE,
        },
    }
    return Operation(
        summary=f"OpenAI's {'chat ' if chat else ''}completion, whole or streamed",
        tag="openai",
        parameters=(REQUEST_ID, TIMEOUT),
        body=body,
        answers={
            200: Answer(
                description="the completion (or, with stream, its chunks)",
                schema=answer,
                more={"text/event-stream": SSE},
            ),
            **errors(400, 401, 404, 409, 413, 429, 500, 503, 504, openai=True),
        },
        auth="key",
    )
