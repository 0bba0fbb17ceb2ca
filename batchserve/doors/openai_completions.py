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
where their value changes nothing here (`tools: []`, `n: 1`, `store`, ...) and refused (400,
naming the field) where it would change the answer (`openai_fields.py`), never ignored.
Errors carry OpenAI's body shape, which its clients raise as typed exceptions; a failure
mid-stream is a `data: {"error": ...}` chunk, which the official client raises.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from aiohttp import web

from ..config import Config
from ..engine.core import Engine
from ..errors import BatchserveError, InvalidInput
from ..generation.request import Generation
from ..models.grammar import Constraint
from ..rules.sampling_params import SCHEMAS
from .generate_api import SSE, STOP, max_tokens_schema
from .generation_answer import Events, answer_generation, data_event
from .openai_fields import check_fields, neutral_schemas, sampling_params
from .openai_tools import CHAT_SCHEMAS, MESSAGE, ChatShape, one_constraint
from .openapi import REQUEST_ID, TIMEOUT, Answer, ModelName, Operation, errors
from .structured import STRUCTURED_SCHEMAS, constraint_of
from .tool_calls import Tools, read_messages, read_tools
from .wire import CACHE_SALT_SCHEMA, cache_salt_of, read_call, timeout_ms_of


class Completion(NamedTuple):
    """A completions or chat body, read: what the engine needs, and how to answer."""

    model: str
    prompt: str
    """The prompt; for a chat, its messages in the generator's template once read."""
    messages: list[dict[str, Any]] | None
    max_tokens: int | None
    stop: str | list[str] | None
    params: dict[str, Any]
    stream: bool
    include_usage: bool
    timeout_ms: float | None
    cache_salt: str | None
    constraint: Constraint | None
    tools: Tools


class OpenAICompletionsApi:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        engine = self._engine
        arrival = engine.clock.time()
        route = "chat_completions" if chat else "completions"

        def parse(payload: dict[str, Any], request: web.Request) -> Completion:
            """The body, a chat's messages made one prompt here, so that a refusal of
            either (an unknown model) is recorded like any other bad body."""
            body = _read_completion(payload, request, chat=chat)
            if body.messages is None:
                return body
            prompt = engine.generation.chat_prompt(body.model, body.messages, body.tools.listed)
            return body._replace(prompt=prompt)

        like = CHAT_LIKE if chat else COMPLETION_LIKE
        call = await read_call(request, engine, route, arrival, parse, like=like, openai_shape=True)
        if isinstance(call, web.Response):
            return call
        body = call.body
        answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{call.request_id}"
        shape = _Shape(chat, answer_id, body.model, ChatShape(body.tools.reads_calls))
        generating = engine.generate(
            body.prompt,
            model=body.model,
            max_tokens=body.max_tokens,
            stop=body.stop,
            params=body.params,
            timeout_ms=body.timeout_ms,
            request_id=call.request_id,
            tenant=call.tenant,
            arrival=arrival,
            route=route,
            cache_salt=body.cache_salt,
            constraint=body.constraint,
        )
        events = Events(
            piece=shape.piece,
            ending=lambda gen: shape.ending(gen, body.include_usage),
            failure=_failure_chunk,
        )
        return await answer_generation(
            request,
            generating,
            call.request_id,
            stream=body.stream,
            events=events,
            whole=shape.whole,
            openai_shape=True,
        )


class _Shape:
    """How one answer is written: a completion or a chat completion, whole or in chunks."""

    def __init__(self, chat: bool, answer_id: str, model: str, calls: ChatShape) -> None:
        self._chat = chat
        self._calls = calls
        self._head = {
            "id": answer_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self._started = False

    def whole(self, gen: Generation, output: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": gen.finish_reason}
        if self._chat:
            choice |= self._calls.whole(output, gen.finish_reason)
        else:
            choice |= {"text": output, "logprobs": None}
        return self._head | {"choices": [choice], "usage": _usage(gen)}

    def piece(self, text: str) -> bytes:
        if not self._chat:
            return self._chunk(text, None)
        return b"".join(self._delta_chunk(delta) for delta in self._calls.feed(text))

    def ending(self, gen: Generation, include_usage: bool) -> bytes:
        held = b"".join(self._delta_chunk(delta) for delta in self._calls.flush())
        ending = held + self._chunk("", self._calls.finish_reason(gen.finish_reason))
        if include_usage:
            ending += data_event(self._chunk_head() | {"choices": [], "usage": _usage(gen)})
        return ending

    def _delta_chunk(self, delta: dict[str, Any]) -> bytes:
        if not self._started:
            delta["role"] = "assistant"
        self._started = True
        choice = {"index": 0, "finish_reason": None, "delta": delta}
        return data_event(self._chunk_head() | {"choices": [choice]})

    def _chunk(self, text: str, finish_reason: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self._chat:
            delta: dict[str, str] = {} if finish_reason else {"content": text}
            if not self._started:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice |= {"text": text, "logprobs": None}
        self._started = True
        return data_event(self._chunk_head() | {"choices": [choice]})

    def _chunk_head(self) -> dict[str, Any]:
        if self._chat:
            return self._head | {"object": "chat.completion.chunk"}
        return self._head


def _usage(gen: Generation) -> dict[str, Any]:
    made = len(gen.seq.tokens)
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": made,
        "total_tokens": gen.prompt_tokens + made,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def _failure_chunk(error: BatchserveError) -> bytes:
    return data_event(
        {"error": {"message": str(error), "type": error.code.lower(), "code": error.code}}
    )


def _read_completion(payload: dict[str, Any], request: web.Request, *, chat: bool) -> Completion:
    check_fields(payload, chat=chat)
    model = payload.get("model")
    if not isinstance(model, str):
        raise InvalidInput('the body needs a string field "model"')
    messages = read_messages(payload.get("messages")) if chat else None
    tools = read_tools(payload) if chat else Tools(None, None)
    prompt = "" if chat else _prompt(payload.get("prompt"))
    max_tokens = payload.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = payload.get("max_tokens")
    stream = payload.get("stream") or False
    options = payload.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise InvalidInput('"stream" must be true or false, "stream_options" an object')
    return Completion(
        model,
        prompt,
        messages,
        max_tokens,
        payload.get("stop"),
        sampling_params(payload),
        stream,
        options.get("include_usage") is True,
        timeout_ms_of(None, request),
        cache_salt_of(payload),
        one_constraint(constraint_of(payload), tools.constraint),
        tools,
    )


def _prompt(given: object) -> str:
    if isinstance(given, list) and len(given) == 1:
        given = given[0]
    if not isinstance(given, str):
        raise InvalidInput('"prompt" must be a string (or a list of one string)')
    return given


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
    text = (
        {
            "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
            "max_completion_tokens": max_tokens_schema(config),
            **CHAT_SCHEMAS,
        }
        if chat
        else {
            "prompt": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
                ]
            }
        }
    )
    name = "ChatCompletion" if chat else "Completion"
    body = {
        "title": f"{name}Request",
        "type": "object",
        "required": ["model", "messages" if chat else "prompt"],
        "additionalProperties": False,
        "properties": {
            "model": ModelName("generation"),
            **text,
            "max_tokens": max_tokens_schema(config),
            "stop": STOP,
            "cache_salt": CACHE_SALT_SCHEMA,
            "stream": {"type": ["boolean", "null"]},
            "stream_options": {
                "type": ["object", "null"],
                "properties": {"include_usage": {"type": "boolean"}},
            },
            **SCHEMAS,
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
            "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": _CHOICE},
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
