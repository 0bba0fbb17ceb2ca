"""`POST /api/generate`: one prompt, its text whole or streamed as server-sent events.

    {"prompt": "...", "max_tokens": 64, "stop": ["\\n"], "params": {}, "stream": true,
     "timeout_ms": 2000, "model": "...", "version": "...", "cache_salt": "..."}

`params` goes to the generator: its sampling keys (`temperature`, `top_p`, `top_k`, `seed`,
`ignore_eos`, `min_tokens`) are checked by `rules/sampling_params.py` (400 naming the key; `null` is
absent), and any other key passes through unchanged for a custom generator to read.

`cache_salt` (vLLM's) keeps the request's cached prefixes to requests with the same salt.
`response_format`, or vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
or `structured_outputs`, holds the output to a grammar (`structured.py`).

Not streaming: 200 {"output", "tokens", "finish_reason", "ttft_ms", "latency_ms", ...};
`cached_tokens` are the prompt's tokens taken from the prefix cache.
Streaming: `data: {"token": "..."}` per piece, a final event with `finish_reason` and the
timings, then `data: [DONE]`; a failure once the stream has started is `event: error` with
`data: {"error": {"code", "message"}}`, then `data: [DONE]`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from aiohttp import web

from ..config import Config
from ..engine.requests import Prompt
from ..errors import BatchserveError, InvalidInput
from ..rules.admission import MAX_STOP_CHARS, MAX_STOPS
from ..rules.sampling_params import LOGPROBS, SCHEMAS
from .face import Generating, Reception
from .generation_answer import Events, answer_generation, data_event
from .openapi import REQUEST_ID, TIMEOUT, Answer, ModelName, Operation, errors
from .structured import STRUCTURED_FIELDS, STRUCTURED_SCHEMAS, constraint_of
from .wire import (
    CACHE_SALT_SCHEMA,
    cache_salt_of,
    model_fields,
    read_call,
    refuse_unknown_fields,
    timeout_ms_of,
)

GENERATE_LIKE = '{"prompt": "...", "max_tokens": 16}'
"""What the body of /api/generate looks like, for a body that does not."""
_FIELDS = frozenset(
    {
        "prompt",
        "max_tokens",
        "stop",
        "params",
        "stream",
        "timeout_ms",
        "model",
        "version",
        "cache_salt",
        *STRUCTURED_FIELDS,
    }
)


class GenerateBody(NamedTuple):
    prompt: Prompt
    stream: bool


def parse_generate(payload: dict[str, Any], request: web.Request) -> GenerateBody:
    """The body's fields, checked for shape; the engine checks their values."""
    refuse_unknown_fields(payload, _FIELDS)
    text = payload.get("prompt")
    if not isinstance(text, str):
        raise InvalidInput('the body needs a string field "prompt"')
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidInput('"stream" must be true or false')
    model, version, params = model_fields(payload)
    asked = [name for name in LOGPROBS if (params or {}).get(name) is not None]
    if asked:  # this answer has no place for them: never computed to be dropped
        raise InvalidInput(
            f'params "{asked[0]}": log probabilities are answered on /v1/completions and'
            " /v1/chat/completions"
        )
    prompt = Prompt(
        text,
        model=model,
        version=version,
        max_tokens=payload.get("max_tokens"),
        stop=payload.get("stop"),
        params=params,
        timeout_ms=timeout_ms_of(payload.get("timeout_ms"), request),
        cache_salt=cache_salt_of(payload),
        constraint=constraint_of(payload),
    )
    return GenerateBody(prompt, stream)


class GenerateApi:
    def __init__(self, reception: Reception, generation: Generating) -> None:
        self._reception = reception
        self._generation = generation

    async def generate(self, request: web.Request) -> web.StreamResponse:
        call = await read_call(
            request, self._reception, "generate", parse_generate, like=GENERATE_LIKE
        )
        if isinstance(call, web.Response):
            return call
        return await answer_generation(
            request,
            self._generation.generate(call.body.prompt, call.caller),
            call.request_id,
            stream=call.body.stream,
            events=EVENTS,
            whole=lambda gen, output: {"output": output, **gen.summary()},
        )


def _failure_event(error: BatchserveError) -> bytes:
    return data_event({"error": {"code": error.code, "message": str(error)}}, event="error")


EVENTS = Events(
    piece=lambda text: data_event({"token": text}),
    ending=lambda gen: data_event(gen.summary()),
    failure=_failure_event,
)


STOP = {"anyOf": [
    {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
    {"type": "array", "maxItems": MAX_STOPS,
     "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
    {"type": "null"},
]}  # fmt: skip
"""`stop`, as the engine checks it, for the OpenAPI document."""
SSE = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "description": "one server-sent event: its data is a JSON object, the last one [DONE]",
}


def max_tokens_schema(config: Config) -> dict[str, Any]:
    return {"type": ["integer", "null"], "minimum": 1, "maximum": config.max_tokens_cap}


def generate_operation(config: Config) -> Operation:
    """POST /api/generate as the OpenAPI document describes it on a server of `config`."""
    body = {
        "title": "GenerateRequest",
        "type": "object",
        "required": ["prompt"],
        "additionalProperties": False,
        "properties": {
            "prompt": {"type": "string"},
            "max_tokens": max_tokens_schema(config),
            "stop": STOP,
            "params": {
                "type": ["object", "null"],
                "properties": SCHEMAS | {name: {"type": "null"} for name in LOGPROBS},
                "description": "sampling params; other keys go to the generator",
            },
            "stream": {"type": "boolean"},
            "timeout_ms": {"type": ["number", "null"], "exclusiveMinimum": 0},
            "model": ModelName("generation", nullable=True),
            "version": {"type": ["string", "null"]},
            "cache_salt": CACHE_SALT_SCHEMA,
            **STRUCTURED_SCHEMAS,
        },
    }
    answer = {
        "title": "Generation",
        "type": "object",
        "required": [
            "output",
            "tokens",
            "prompt_tokens",
            "finish_reason",
            "latency_ms",
            "model",
            "version",
            "request_id",
        ],
        "properties": {
            "output": {"type": "string"},
            "tokens": {"type": "integer", "minimum": 0},
            "prompt_tokens": {"type": "integer", "minimum": 0},
            "cached_tokens": {"type": "integer", "minimum": 0},
            "finish_reason": {"type": ["string", "null"]},
            "ttft_ms": {"type": ["number", "null"]},
            "latency_ms": {"type": "number"},
            "model": {"type": "string"},
            "version": {"type": "string"},
            "request_id": {"type": "string"},
        },
    }
    return Operation(
        summary="Generate text from one prompt, whole or streamed as server-sent events",
        tag="generation",
        parameters=(REQUEST_ID, TIMEOUT),
        body=body,
        answers={
            200: Answer(
                description="the text and its numbers (or, with stream, the events)",
                schema=answer,
                more={"text/event-stream": SSE},
            ),
            **errors(400, 401, 404, 409, 413, 429, 500, 503, 504),
        },
        auth="key",
    )
