"""What both clients share, and no I/O: the error classes, the answers' shapes, reading an
answer, and the retry rules (`_Attempts`) with each call's deadline.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import orjson

try:
    import httpx
except ImportError as missing:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "batchserve.client needs httpx, which the server does not install: "
        "pip install 'batchserve[client]'",
        name=missing.name,
    ) from missing

RETRIED = frozenset({429, 503})
FIRST_BACKOFF_S = 0.05
"""The wait before a retry when the server named none (a refused connection), doubling."""
JITTER = 0.5
"""A retry waits the asked time x uniform(1, 1 + JITTER), so that retries do not arrive
together."""


class ServerError(Exception):
    """An error answer: its HTTP status, the server's code and message, the request's id."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        request_id: str,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
        self.request_id, self.retry_after_s = request_id, retry_after_s


class InvalidRequest(ServerError):
    """400, 404, 405, 409 or 413: the call as sent can never succeed."""


class Unauthenticated(ServerError):
    """401: no API key, or one the server does not know."""


class RateLimited(ServerError):
    """429: the key's rate; retried while the deadline allows."""


class BackendError(ServerError):
    """500: the model failed on this input."""


class Unavailable(ServerError):
    """503 (OVERLOADED, NOT_READY) or no replica reachable; retried while the deadline
    allows."""


class UnexpectedAnswer(ServerError):
    """A success answer the client cannot read: not JSON, or without a field the call
    needs (a proxy's page, a server of another kind); `status` is the answer's."""


class DeadlineExceeded(ServerError):
    """504 from the server, or the caller's deadline passed (or would, before the retry the
    server asked for) on this side; `last_error` is the answer that was being retried."""

    last_error: ServerError | None = None


_BY_STATUS: dict[int, type[ServerError]] = {
    401: Unauthenticated,
    429: RateLimited,
    500: BackendError,
    503: Unavailable,
    504: DeadlineExceeded,
}


@dataclass(frozen=True, slots=True)
class Inference:
    """An answer; the fields after `request_id` are None where the server sent none."""

    output: Any
    request_id: str
    model: str | None
    version: str | None
    latency_ms: float | None
    batch_size: int | None


@dataclass(frozen=True, slots=True)
class Status:
    """A submitted request as the server last saw it: queued, running, completed or failed."""

    request_id: str
    status: str
    result: Inference | None = None
    error: ServerError | None = None


@dataclass(frozen=True, slots=True)
class Generated:
    output: str
    tokens: int
    finish_reason: str
    request_id: str


def _inference(body: Mapping[str, Any], status: int = 200) -> Inference:
    request_id = _need(body, "request_id", "", status)
    return Inference(
        _need(body, "output", request_id, status),
        request_id,
        body.get("model"),
        body.get("version"),
        body.get("latency_ms"),
        body.get("batch_size"),
    )


def _need(body: Mapping[str, Any], name: str, request_id: str, status: int = 200) -> Any:
    """A field the call cannot do without; UnexpectedAnswer if the answer lacks it."""
    if name not in body:
        raise UnexpectedAnswer(
            status,
            "UNEXPECTED_ANSWER",
            f"the answer has no {name!r} field: {str(body)[:200]}",
            str(body.get("request_id", request_id)),
        )
    return body[name]


def _error(status: int, body: Mapping[str, Any], request_id: str) -> ServerError:
    """Our error body ({"error": code, "message"}) or the OpenAI-shaped one
    ({"error": {"code", "message"}}) of the /v1 routes."""
    error = body.get("error")
    code, message = (
        (error.get("code", ""), error.get("message", ""))
        if isinstance(error, dict)
        else (str(error or f"HTTP_{status}"), str(body.get("message", "")))
    )
    retry_ms = body.get("retry_after_ms")
    return _BY_STATUS.get(status, InvalidRequest)(
        status,
        code,
        message,
        str(body.get("request_id", request_id)),
        retry_ms / 1e3 if isinstance(retry_ms, int | float) else None,
    )


def _answer(content: bytes, request_id: str) -> dict[str, Any]:
    """A success answer's body, with the request id sent where it names none."""
    body = _body(content)
    body.setdefault("request_id", request_id)
    return body


def _body(content: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {"message": content[:200].decode(errors="replace")}
    return body if isinstance(body, dict) else {"message": str(body)[:200]}


class _Attempts:
    """One call's id, deadline and retry decisions; no I/O, so both clients share it."""

    def __init__(
        self,
        timeout_s: float,
        clock: Callable[[], float],
        rng: random.Random,
        request_id: str | None = None,
    ) -> None:
        self.request_id = request_id or uuid.uuid4().hex
        self._clock, self._rng = clock, rng
        self._deadline = clock() + timeout_s
        self._backoff_s = FIRST_BACKOFF_S
        self.resent = False
        """Whether a try failed after it may have reached the server."""
        self.submitting = False
        """A submit: its id met again after a resend means the first try got through."""

    def time_left(self) -> float:
        """Seconds before the deadline; raises DeadlineExceeded once there are none."""
        left = self._deadline - self._clock()
        if left <= 0:
            raise DeadlineExceeded(504, "DEADLINE_EXCEEDED", "the deadline passed", self.request_id)
        return left

    def headers(self) -> dict[str, str]:
        return {
            "X-Request-Id": self.request_id,
            "X-Request-Timeout-Ms": f"{self.time_left() * 1e3:.0f}",
        }

    def check(self, status: int, content: bytes) -> float | None:
        """None for a 2xx answer; the wait before retrying a 503 or 429; raises the error
        of any other answer, or DeadlineExceeded when the wait would cross the deadline."""
        if status < 300:
            return None
        error = _error(status, _body(content), self.request_id)
        if self.resent and self.submitting and error.code == "DUPLICATE_REQUEST_ID":
            return None  # an earlier try of this very submit was accepted
        if status not in RETRIED:
            raise error
        return self._wait(error, error.retry_after_s)

    def refused(self, cause: httpx.TransportError) -> float:
        """The wait before retrying after the connection failed: refused (a replica gone) or
        closed before the answer. Sent again under the same id, as inference has no side
        effects; a submit that got through the first time then meets its own id (`check`)."""
        self.resent = True
        error = Unavailable(503, "UNREACHABLE", str(cause) or type(cause).__name__, self.request_id)
        return self._wait(error, None)

    def _wait(self, error: ServerError, asked_s: float | None) -> float:
        base = asked_s if asked_s is not None else self._backoff_s
        self._backoff_s *= 2
        wait = base * self._rng.uniform(1.0, 1.0 + JITTER)
        if wait >= self._deadline - self._clock():
            late = DeadlineExceeded(
                504,
                "DEADLINE_EXCEEDED",
                f"the deadline would pass before the retry the answer asked for ({error})",
                self.request_id,
            )
            late.last_error = error
            raise late from error
        return wait


class _SseReader:
    """Server-sent events of POST /api/generate, line by line: token texts, then the end;
    an `event: error` raises its error."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._event: str | None = None

    def line(self, line: str) -> str | None:
        """The token text this line carries, if any."""
        if line.startswith("event:"):
            self._event = line[6:].strip()
            return None
        if not line.startswith("data:"):
            self._event = None if not line else self._event
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            return None
        payload = orjson.loads(data)
        if self._event == "error":
            raise _error(500, payload, self._request_id)
        token = payload.get("token")
        return token if isinstance(token, str) else None


def _base(url: str | None, uds: str | None) -> str:
    if url is None and uds is None:
        raise ValueError("give the server's url, or uds= for its Unix socket")
    return url or "http://batchserve"


def _generate_body(
    prompt: str, max_tokens: int | None, stream: bool, fields: Mapping[str, Any]
) -> dict[str, Any]:
    body = {"prompt": prompt, "stream": stream, **fields}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def _generated(body: Mapping[str, Any]) -> Generated:
    request_id = _need(body, "request_id", "")
    return Generated(
        _need(body, "output", request_id),
        _need(body, "tokens", request_id),
        _need(body, "finish_reason", request_id),
        request_id,
    )


def _embeddings(body: Mapping[str, Any]) -> list[list[float]]:
    request_id = str(body.get("request_id", ""))
    rows = _need(body, "data", request_id)
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise UnexpectedAnswer(200, "UNEXPECTED_ANSWER", "the answer's 'data' is not a list of"
                               " objects", request_id)  # fmt: skip
    return [_need(row, "embedding", request_id) for row in rows]


def _poll_path(request_id: str, wait_s: float) -> str:
    path = f"/api/requests/{quote(request_id, safe='')}"
    return f"{path}?wait_ms={round(wait_s * 1e3)}" if wait_s > 0 else path


def _status(body: Mapping[str, Any], request_id: str) -> Status:
    status = _need(body, "status", request_id)
    if status == "completed":
        return Status(request_id, status, result=_inference(body))
    if status == "failed":
        failure = _need(body, "error", request_id)
        if not isinstance(failure, dict):
            failure = {"error": str(failure)}
        code = failure.get("status")
        error = _error(code if isinstance(code, int) else 500, failure, request_id)
        return Status(request_id, status, error=error)
    return Status(request_id, status)


class _Deadlines:
    """A client's default deadline and its jitter's random source: each call's `_Attempts`."""

    def __init__(self, timeout_s: float, seed: int | None) -> None:
        self._timeout_s = timeout_s
        self._rng = random.Random(seed)

    def attempts(self, timeout: float | None, request_id: str | None) -> _Attempts:
        timeout_s = self._timeout_s if timeout is None else timeout
        return _Attempts(timeout_s, time.monotonic, self._rng, request_id)


def _without_none(body: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in body.items() if value is not None}
