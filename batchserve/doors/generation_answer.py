"""One generation's HTTP answer, for every door that generates: whole, or as server-sent
events (one event per piece of text as soon as it is made).

The stream opens only once the first piece is made (or the generation ends), so a request
that fails before its first token (a deadline, a failed first step) still gets a plain HTTP
error answer with the right status. A failure after that arrives as an event the door
shapes, then `data: [DONE]` as after any stream (vLLM's order; a client that waits for the
terminator is not left hanging), and the stream ends. A client that leaves makes a write
raise (or the handler is cancelled): leaving `async with engine.generate(...)` then
cancels the sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import orjson
from aiohttp import web

from ..errors import BatchserveError
from ..generation.request import Generation
from .wire import error_response, json_response

DONE = b"data: [DONE]\n\n"
STREAM_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class Events(NamedTuple):
    """How a door writes its stream: each piece, the ending or a failure (before [DONE])."""

    piece: Callable[[str], bytes]
    ending: Callable[[Generation], bytes]
    failure: Callable[[BatchserveError], bytes]


def data_event(payload: dict[str, Any], event: str | None = None) -> bytes:
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + orjson.dumps(payload) + b"\n\n"


async def answer_generation(
    request: web.Request,
    generating: contextlib.AbstractAsyncContextManager[Generation],
    request_id: str,
    *,
    stream: bool,
    events: Events,
    whole: Callable[[Generation, str], dict[str, Any]],
    openai_shape: bool = False,
) -> web.StreamResponse:
    """Runs `generating` (an `engine.generate(...)`) and answers: `whole(gen, output)` as
    JSON, or (`stream`) `events`; a refusal or failure before the first piece is an error
    answer, in OpenAI's body shape where asked."""
    headers = {"X-Request-Id": request_id}
    try:
        async with generating as gen:
            if stream:
                return await _stream(request, gen, headers, events, openai_shape)
            output = await gen.result()
    except BatchserveError as error:
        return error_response(error, request_id, openai_shape=openai_shape)
    return json_response(200, whole(gen, output), headers)


async def _stream(
    request: web.Request,
    gen: Generation,
    headers: dict[str, str],
    events: Events,
    openai_shape: bool,
) -> web.StreamResponse:
    async with contextlib.aclosing(gen.pieces()) as pieces:
        try:
            first: str | None = await anext(pieces)
        except StopAsyncIteration:
            first = None
        except BatchserveError as error:
            return error_response(error, headers["X-Request-Id"], openai_shape=openai_shape)
        response = web.StreamResponse(headers=STREAM_HEADERS | headers)
        await response.prepare(request)
        try:
            if first is not None:
                await response.write(events.piece(first))
                async for text in pieces:
                    await response.write(events.piece(text))
            await response.write(events.ending(gen) + DONE)
        except BatchserveError as error:
            await response.write(events.failure(error) + DONE)
        await response.write_eof()
        return response
