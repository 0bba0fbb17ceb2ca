"""Server-sent events for generations: one event per piece of text as soon as it is made.

The stream opens only once the first piece is made (or the generation ends), so a request
that fails before its first token (a deadline, a failed first step) still gets a plain HTTP
error answer with the right status. A failure after that arrives as an event the door
shapes, and the stream ends. A client that leaves makes a write raise (or the handler is
cancelled): the caller's `async with engine.generate(...)` then cancels the sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from .errors import BatchserveError
from .generation import Generation

DONE = b"data: [DONE]\n\n"
_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def data_event(payload: dict[str, Any], event: str | None = None) -> bytes:
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + orjson.dumps(payload) + b"\n\n"


async def stream_generation(
    request: web.Request,
    gen: Generation,
    headers: dict[str, str],
    *,
    piece: Callable[[str], bytes],
    ending: Callable[[Generation], bytes],
    failure: Callable[[BatchserveError], bytes],
    refusal: Callable[[BatchserveError], web.Response],
) -> web.StreamResponse:
    """Writes `gen` as events: `piece(text)` for each piece, `ending(gen)` and [DONE] once it
    ends, `failure(error)` if it fails mid-stream; `refusal(error)` answers a failure before
    the first piece."""
    async with contextlib.aclosing(gen.pieces()) as pieces:
        try:
            first: str | None = await anext(pieces)
        except StopAsyncIteration:
            first = None
        except BatchserveError as error:
            return refusal(error)
        response = web.StreamResponse(headers=_HEADERS | headers)
        await response.prepare(request)
        try:
            if first is not None:
                await response.write(piece(first))
                async for text in pieces:
                    await response.write(piece(text))
            await response.write(ending(gen) + DONE)
        except BatchserveError as error:
            await response.write(failure(error))
        await response.write_eof()
        return response
