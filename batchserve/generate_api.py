"""`POST /api/generate`: one prompt, its text whole or streamed as server-sent events.

    {"prompt": "...", "max_tokens": 64, "stop": ["\\n"], "params": {}, "stream": true,
     "timeout_ms": 2000, "model": "...", "version": "..."}

Not streaming: 200 {"output", "tokens", "finish_reason", "ttft_ms", "latency_ms", ...}.
Streaming: `data: {"token": "..."}` per piece, a final event with `finish_reason` and the
timings, then `data: [DONE]`; a failure once the stream has started is `event: error` with
`data: {"error": {"code", "message"}}`, and the stream ends.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from aiohttp import web

from .engine import Engine
from .errors import BatchserveError, InvalidInput
from .http_io import (
    error_response,
    json_response,
    model_fields,
    read_call,
    read_json,
    refuse_unknown_fields,
    timeout_ms_of,
)
from .sse import data_event, stream_generation

_FIELDS = frozenset(
    {"prompt", "max_tokens", "stop", "params", "stream", "timeout_ms", "model", "version"}
)


class GenerateBody(NamedTuple):
    prompt: str
    max_tokens: int | None
    stop: str | list[str] | None
    params: dict[str, Any] | None
    stream: bool
    timeout_ms: float | None
    model: str | None
    version: str | None


async def read_generate(request: web.Request, limit: int) -> GenerateBody:
    """The body's fields, checked for shape; the engine checks their values."""
    payload = await read_json(request, limit)
    refuse_unknown_fields(payload, _FIELDS)
    prompt = payload.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidInput('the body needs a string field "prompt"')
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidInput('"stream" must be true or false')
    model, version, params = model_fields(payload)
    return GenerateBody(
        prompt,
        payload.get("max_tokens"),
        payload.get("stop"),
        params,
        stream,
        timeout_ms_of(payload.get("timeout_ms"), request),
        model,
        version,
    )


class GenerateApi:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def generate(self, request: web.Request) -> web.StreamResponse:
        engine = self._engine
        arrival = engine.clock.time()
        call = await read_call(request, engine, "generate", arrival, read_generate)
        if isinstance(call, web.Response):
            return call
        request_id, body = call.request_id, call.body
        headers = {"X-Request-Id": request_id}
        try:
            async with engine.generate(
                body.prompt,
                model=body.model,
                version=body.version,
                max_tokens=body.max_tokens,
                stop=body.stop,
                params=body.params,
                timeout_ms=body.timeout_ms,
                request_id=request_id,
                tenant=call.tenant,
                arrival=arrival,
            ) as gen:
                if body.stream:
                    return await stream_generation(
                        request,
                        gen,
                        headers,
                        piece=lambda text: data_event({"token": text}),
                        ending=lambda ended: data_event(ended.summary()),
                        failure=_failure_event,
                        refusal=lambda error: error_response(error, request_id),
                    )
                output = await gen.result()
        except BatchserveError as error:
            return error_response(error, request_id)
        return json_response(200, {"output": output, **gen.summary()}, headers)


def _failure_event(error: BatchserveError) -> bytes:
    return data_event({"error": {"code": error.code, "message": str(error)}}, event="error")
