"""One HTTP connection as a hostile client meets it: aiohttp's protocol with deadlines, a cap
on the bytes that unfinished bodies hold, and the API's JSON for what aiohttp refuses.

aiohttp bounds a connection only while it waits for a request (its keep-alive timeout).
`Connection` adds what it lacks, each a deadline on the loop's clock:

- header: a request's head must arrive whole within `header_timeout_s` of the
  connection's opening or of the head's first byte;
- body: a body must not stall for `body_timeout_s` between two of its bytes, must arrive
  whole within `body_deadline_s` of its head, and, after `body_rate_grace_s`, must
  average `body_min_rate` bytes a second (`body_due`): a trickle of a byte now and then
  meets the first rule, never the other two;
- write: bytes of an answer that the client does not take stay unsent at most
  `write_timeout_s` (the transport's buffer signals any unsent byte, not only 64 KiB);
- keep-alive: aiohttp's own, `keepalive_timeout_s` between answer and next request.

A connection past a deadline is closed: at once when no request is being handled, else
once the answer in hand is written (an unsent answer is dropped). A request whose body its
head did not bring whole is first checked on its head alone (`refused_by_head`: its key,
its Content-Length): one refused there takes none of the budget, and its handler refuses
it (401, 413, in its route's own error shape) without reading its body. The body of any
other counts, for its Content-Length (the body limit when chunked), against one
`BodyBudget`, in all and for its client's address; a request whose body does not fit is
answered 503 OVERLOADED and its connection closed.

aiohttp answers what it cannot parse itself, in plain text and with a traceback in the log;
here it is the API's JSON error with an `X-Request-Id`, and one line in the log. Pipelined
requests are parsed one at a time, so that a malformed request after good ones in the same
segment costs only itself: the good ones are answered, then it gets its 400.

This leans on aiohttp's protocol internals (its message queue and parser), pinned in
pyproject.toml; tests/test_connections.py covers each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

from aiohttp import hdrs, web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.http import HttpRequestParser, RawRequestMessage
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo

from ..config import Config
from ..errors import BatchserveError, InvalidInput
from .body_budget import BodyBudget, client_address
from .wire import error_response, request_id_in, request_id_of, status_response

log = logging.getLogger("batchserve.connections")
MAX_REASON = 200
"""A refusal's reason, in its answer and its log line, is cut to this many characters."""
DECODED_ENCODINGS = ", ".join(["gzip", "deflate"] + ["br"] * HAS_BROTLI + ["zstd"] * HAS_ZSTD)
"""The Content-Encodings aiohttp decodes here: br and zstd only where their packages are
installed (tritonclient[http], in the test extra, brings brotli)."""


HeadCheck = Callable[[str, Mapping[str, str]], BatchserveError | None]
"""What a request (its path, its headers) is refused for before any of its body is read:
server.py's `refused_by_head` (a missing or unknown key, a Content-Length over the limit)."""
BodyRule = Literal["body", "whole-body", "body rate"]


def body_due(settings: Config, start: float, seen: float, received: int) -> tuple[float, BodyRule]:
    """When a body still arriving is cut, and by which rule: `body_timeout_s` after its last
    byte (`seen`), `body_deadline_s` after its head (`start`), or once fewer than
    `body_min_rate` bytes a second have come since `body_rate_grace_s` after its head
    (`received` bytes so far). Each moves only later as bytes come."""
    due: list[tuple[float, BodyRule]] = [
        (seen + settings.body_timeout_s, "body"),
        (start + settings.body_deadline_s, "whole-body"),
    ]
    if settings.body_min_rate > 0:
        paid = received / settings.body_min_rate
        due.append((start + settings.body_rate_grace_s + paid, "body rate"))
    return min(due)


class ConnectionServer(web.Server):
    """aiohttp's server, making a `Connection` for each connection, with the settings of
    the moment (a reload applies to connections opened after it)."""

    def __init__(
        self,
        *args: Any,
        settings: Callable[[], Config],
        refused_by_head: HeadCheck,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._settings = settings
        self._refused_by_head = refused_by_head
        self.budget = BodyBudget(
            lambda: settings().max_unfinished_body_bytes,
            lambda: settings().max_unfinished_body_bytes_per_address,
        )

    def __call__(self) -> Connection:
        settings = self._settings()
        kwargs = {**self._kwargs, "keepalive_timeout": settings.keepalive_timeout_s}
        return Connection(
            self, settings, self.budget, self._refused_by_head, loop=self._loop, **kwargs
        )


class Connection(RequestHandler):
    __slots__ = (
        "_address", "_body", "_body_held", "_body_received", "_body_seen", "_body_start",
        "_body_timer", "_budget", "_head_timer", "_refusal", "_refused", "_refused_by_head",
        "_settings", "_write_timer",
    )  # fmt: skip

    def __init__(
        self,
        manager: web.Server,
        settings: Config,
        budget: BodyBudget,
        refused_by_head: HeadCheck,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        # A parser that stops after each complete request: aiohttp's, given a segment that
        # holds good requests and then a malformed one, raises and loses the good ones.
        self._parser = HttpRequestParser(
            self, kwargs["loop"], self._read_bufsize,
            max_line_size=self.max_line_size, max_field_size=self.max_field_size,
            max_headers=self.max_headers, payload_exception=RequestPayloadError,
            auto_decompress=kwargs.get("auto_decompress", True), max_msg_queue_size=1,
        )  # fmt: skip
        self._settings = settings
        self._budget = budget
        self._refused_by_head = refused_by_head
        self._address: str | None = None
        """The client's address, as the budget bounds it (`client_address`)."""
        self._head_timer: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None
        """The body still arriving, of the last request parsed."""
        self._body_held = 0
        self._body_start = self._body_seen = 0.0
        """When its head was whole; when its last bytes came."""
        self._body_received = 0
        """Its bytes come since its head, as sent (compressed, chunk sizes and all)."""
        self._body_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused = False
        """Answered with a refusal that closes the connection: nothing more is parsed."""
        self._refusal: tuple[BatchserveError, str] | None = None
        """The refusal of a request refused on its head, and that request's id."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._address = client_address(transport.get_extra_info("peername"))
        # Any byte the kernel does not take at once pauses writing (and starts the write
        # deadline); writing resumes once every byte is gone.
        transport.set_write_buffer_limits(high=0)  # type: ignore[attr-defined]
        self._arm_head(self._loop.time())

    def connection_lost(self, exc: BaseException | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._write_timer = None
        self._end_body()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._body is not None:
            self._body_seen = self._loop.time()
            self._body_received += len(data)
        before = queued = len(self._messages)
        super().data_received(data)
        # The parser stops after each request: parse on while it finds more, up to the
        # queue's bound (which pauses reading; aiohttp resumes it, and this, as it drains).
        while (
            len(self._messages) > queued
            and len(self._messages) < self._max_msg_queue_size
            and isinstance(self._messages[-1][0], RawRequestMessage)
            and not (self._upgraded or self._close or self._force_close)
        ):
            queued = len(self._messages)
            super().data_received(b"")
        if self._body is not None and self._body.is_eof():
            self._end_body()
        if len(self._messages) > before:
            self._parsed()
        elif data and self._body is None and self._head_timer is None:
            self._arm_head(self._loop.time())  # a head begun, not yet whole

    def _parsed(self) -> None:
        """After a segment that completed one or more heads: the head deadline is met; the
        last request's body, if still arriving, is checked on its head (keys first), then
        takes its share of the budget, or its request is answered 503."""
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        message, payload = self._messages[-1]
        if not isinstance(message, RawRequestMessage):
            self._refused = True  # aiohttp's parser can go no further: answered 400
            return
        if payload is EMPTY_PAYLOAD or payload.is_eof():
            return
        length = message.headers.get(hdrs.CONTENT_LENGTH)
        limit = self._settings.max_body_bytes
        size = limit if length is None else min(int(length), limit)
        if self._refused_by_head(message.url.path, message.headers) is not None:
            # Its handler refuses it on the same head, in its route's own words, and reads
            # none of it: it takes no budget, and the connection closes after that answer
            # rather than lingering to read the rest.
            size, self._lingering_time = 0, 0.0
        elif refusal := self._budget.reserve(self._address, size):
            self._messages[-1] = (_ErrInfo(refusal.status, refusal, str(refusal)), EMPTY_PAYLOAD)
            self._refused, self._refusal = True, (refusal, request_id_in(message.headers)[0])
            return
        self._body, self._body_held = payload, size
        self._body_start = self._body_seen = self._loop.time()
        self._body_received = 0
        self._body_timer = self._loop.call_at(
            body_due(self._settings, self._body_start, self._body_seen, 0)[0],
            self._body_deadline,
        )

    def drop_body(self) -> None:
        """The answer in hand is final and no body will be read (an `Expect: 100-continue`
        refused): the rest of the connection's bytes are ignored, and it closes once that
        answer is written, with no wait for a body the client was told not to send."""
        self._refused = True
        if self._body is not None:
            self._body.feed_eof()

    def _end_body(self) -> None:
        self._budget.release(self._address, self._body_held)
        self._body, self._body_held = None, 0
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _arm_head(self, now: float) -> None:
        self._head_timer = self._loop.call_at(
            now + self._settings.header_timeout_s, self._head_deadline
        )

    def _head_deadline(self) -> None:
        self._head_timer = None
        if self._body is None:
            self._expire("header", finish_current=self._current_request is not None)

    def _body_deadline(self) -> None:
        self._body_timer = None
        body = self._body
        if body is None or body.is_eof():
            return
        due, rule = body_due(self._settings, self._body_start, self._body_seen, self._body_received)
        if self._loop.time() < due:  # bytes came since it was armed
            self._body_timer = self._loop.call_at(due, self._body_deadline)
            return
        current = self._current_request
        self._expire(rule, finish_current=current is not None and current.content is not body)

    def _expire(self, which: str, finish_current: bool) -> None:
        """Closes the connection at once, or once the answer in hand is written when a
        request (not the one whose deadline passed) is being handled."""
        log.info("closing a connection from %s: its %s deadline passed", self.peername, which)
        if finish_current:
            self.close()
        else:
            self.force_close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self._loop.call_at(
                self._loop.time() + self._settings.write_timeout_s, self._write_deadline
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_deadline(self) -> None:
        self._write_timer = None
        log.info("closing a connection from %s: its write deadline passed", self.peername)
        if self.transport is not None:
            self.transport.abort()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The API's JSON error for what aiohttp refuses (a head it cannot parse, a handler
        that raised), one line in the log (a traceback only for a server fault), and the
        connection closed after it."""
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was begun; no other can be sent")
        refusal = self._refusal
        if refusal is not None and refusal[0] is exc:
            request_id = refusal[1]  # refused on its head, whose headers it had
        else:
            request_id = request_id_of(request)[0]  # a head that did not parse has none
        reason = (message or "").strip().split("\n", 1)[0][:MAX_REASON]
        response: web.Response
        if isinstance(exc, BatchserveError):
            response = error_response(exc, request_id)
        elif isinstance(exc, ContentEncodingError) and status == 400:
            response = status_response(
                415,
                f"the body's Content-Encoding is not one this server decodes ({DECODED_ENCODINGS})",
                request_id,
                {"Accept-Encoding": DECODED_ENCODINGS},
            )
        elif status == 400:
            malformed = InvalidInput(f"a malformed HTTP request: {reason}")
            response = error_response(malformed, request_id)
        else:
            self.logger.error("error handling a request from %s", request.remote, exc_info=exc)
            return_status = status if status in (500, 504) else 500
            text = "the server failed to answer this request; see its log"
            response = status_response(return_status, text, request_id)
        if status == 400 or isinstance(exc, BatchserveError):
            log.info("refused a request from %s: %d %s", request.remote, response.status, reason)
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """One line, not aiohttp's traceback: what reaches here was already answered (a body
        that could not be read, read on after its answer) or is the client's fault."""
        exc = kwargs.get("exc_info")
        lines = str(exc).strip().splitlines() if isinstance(exc, BaseException) else []
        what = f"{type(exc).__name__}: {lines[-1].strip() if lines else ''}" if exc else ""
        log.info("%s (%s)", args[0] % args[1:] if args else "", what[:MAX_REASON])
