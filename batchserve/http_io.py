"""The API's wire format: reading a request's id and body, writing answers and errors.

Only this module maps the error tree to HTTP statuses and codes.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import orjson
from aiohttp import web

from .config import Config
from .errors import (
    BackendError,
    BatchserveError,
    DeadlineExceeded,
    DuplicateRequestId,
    InputTooLarge,
    InvalidInput,
    NotFound,
    NotReady,
    Overloaded,
    RateLimited,
    Unauthenticated,
)
from .item import Result

STATUS: dict[type[BatchserveError], tuple[int, str]] = {
    InvalidInput: (400, "INVALID_INPUT"),
    Unauthenticated: (401, "UNAUTHENTICATED"),
    NotFound: (404, "NOT_FOUND"),
    DuplicateRequestId: (409, "DUPLICATE_REQUEST_ID"),
    InputTooLarge: (413, "INPUT_TOO_LARGE"),
    RateLimited: (429, "RATE_LIMITED"),
    BackendError: (500, "BACKEND_ERROR"),
    Overloaded: (503, "OVERLOADED"),
    NotReady: (503, "NOT_READY"),
    DeadlineExceeded: (504, "DEADLINE_EXCEEDED"),
}
_BODY_FIELDS = frozenset({"input", "timeout_ms"})
MAX_REQUEST_ID = 128


def request_id_of(request: web.Request) -> tuple[str, InvalidInput | None]:
    """The client's X-Request-Id, or a fresh one; an unusable id is replaced, never echoed."""
    given = request.headers.get("X-Request-Id")
    if not given:
        # Unguessable, since an id is what the status API is polled by; token_hex costs a
        # fifth of uuid4().hex, which builds a UUID object around the same random bytes.
        return secrets.token_hex(16), None
    if len(given) > MAX_REQUEST_ID or not given.isprintable():
        problem = InvalidInput(
            f"X-Request-Id must be at most {MAX_REQUEST_ID} printable characters"
        )
        return secrets.token_hex(16), problem
    return given, None


async def read_input(request: web.Request, config: Config) -> tuple[str, float]:
    """The body's input text and the request's timeout in seconds."""
    limit = config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise InputTooLarge(f"the body is over the limit of {limit} bytes")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise InputTooLarge(f"the body is over the limit of {limit} bytes") from None
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the body is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidInput('the body must be a JSON object like {"input": "..."}')
    unknown = payload.keys() - _BODY_FIELDS
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    text = payload.get("input")
    if not isinstance(text, str):
        raise InvalidInput('the body needs a string field "input"')
    try:
        size = len(text.encode())
    except UnicodeEncodeError:
        raise InvalidInput('"input" is not valid Unicode text') from None
    if size > config.max_input_bytes:
        raise InputTooLarge(f"the input is {size} bytes; the limit is {config.max_input_bytes}")
    return text, _timeout_s(payload.get("timeout_ms"), request, config.timeout_ms)


def _timeout_s(in_body: object, request: web.Request, cap_ms: float) -> float:
    """The request's own timeout (body first, then header), capped by the server's."""
    requested: object = in_body
    if requested is None and "X-Request-Timeout-Ms" in request.headers:
        try:
            requested = float(request.headers["X-Request-Timeout-Ms"])
        except ValueError:
            raise InvalidInput("X-Request-Timeout-Ms must be a number") from None
    if requested is None:
        return cap_ms / 1e3
    if (
        isinstance(requested, bool)
        or not isinstance(requested, int | float)
        or not math.isfinite(requested)
        or requested <= 0
    ):
        raise InvalidInput("timeout_ms must be a number above 0")
    return min(float(requested), cap_ms) / 1e3


def answer_body(request_id: str, result: Result, latency_s: float) -> dict[str, Any]:
    return {
        "output": result.output,
        "request_id": request_id,
        "latency_ms": round(latency_s * 1e3, 3),
        "queue_ms": round(result.queue_s * 1e3, 3),
        "compute_ms": round(result.compute_s * 1e3, 3),
        "batch_size": result.batch_size,
    }


def error_body(error: BatchserveError, request_id: str) -> dict[str, Any]:
    return {"error": STATUS[type(error)][1], "message": str(error), "request_id": request_id}


_JSON_TYPE = {"Content-Type": "application/json"}


def json_response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> web.Response:
    """The Content-Type goes in with the other headers: aiohttp's `content_type` argument
    parses the header it sets, and each header set after construction is another call."""
    return web.Response(
        status=status,
        body=orjson.dumps(body),
        headers=_JSON_TYPE if headers is None else _JSON_TYPE | headers,
    )


def error_response(error: BatchserveError, request_id: str) -> web.Response:
    body = error_body(error, request_id)
    headers = {"X-Request-Id": request_id}
    if isinstance(error, Overloaded | RateLimited):
        body["retry_after_ms"] = max(1, round(error.retry_after_s * 1e3))
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    if isinstance(error, RateLimited):
        headers["RateLimit-Limit"] = f"{error.limit:g}"
        headers["RateLimit-Remaining"] = "0"
        headers["RateLimit-Reset"] = str(max(1, math.ceil(error.reset_s)))
    if isinstance(error, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    return json_response(STATUS[type(error)][0], body, headers)
