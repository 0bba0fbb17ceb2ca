"""The API's wire format: reading a request's id and body, writing answers and errors.

The only module that turns the error tree (`errors.py`) into HTTP answers.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import orjson
from aiohttp import web

from ..batching.request import Ask, Result, new_request_id
from ..engine.requests import Caller
from ..errors import (
    BatchserveError,
    InputTooLarge,
    InvalidInput,
    MethodNotAllowed,
    NotReady,
    Overloaded,
    RateLimited,
    Unauthenticated,
)
from ..rules.admission import checked_timeout_ms
from .openapi import ModelName

if TYPE_CHECKING:
    from ..rules.tenants import Tenant
    from .face import Reception

_BODY_FIELDS = frozenset({"input", "timeout_ms", "model", "version", "params"})
MAX_REQUEST_ID = 128
TIMEOUT_HEADER = "X-Request-Timeout-Ms"
INPUT_LIKE = '{"input": "..."}'
"""What the body of /api/inference and /api/requests looks like, for a body that does not."""


AskedFor = TypeVar("AskedFor")
AnyRequest = TypeVar("AnyRequest", bound=web.BaseRequest)
"""A door's request: a `web.Request` as aiohttp's routing hands it, or typed as the
`web.BaseRequest` a server hands its handler, as server.py's `AppRunner` hands the
inference door."""

ErrorShape = Callable[[BatchserveError, str], dict[str, Any]]
"""An error answer's JSON body from the error and the request id, for a door whose protocol
has its own (Retry-After and the other headers are added the same for every shape)."""


class Call(NamedTuple, Generic[AskedFor]):
    """Who asks for what: a request read off the wire, before the engine sees it."""

    request_id: str
    tenant: Tenant | None
    body: AskedFor
    arrival: float
    """When the door received it, on the engine's clock."""
    route: str

    @property
    def caller(self) -> Caller:
        """Who asks, as the engine takes it."""
        return Caller(
            request_id=self.request_id, tenant=self.tenant, arrival=self.arrival, route=self.route
        )


async def read_call(
    request: AnyRequest,
    reception: Reception,
    route: str,
    parse_body: Callable[[dict[str, Any], AnyRequest], AskedFor],
    *,
    like: str,
    openai_shape: bool = False,
    read: Callable[[AnyRequest, int, str], Awaitable[dict[str, Any]]] | None = None,
    shape: ErrorShape | None = None,
) -> Call[AskedFor] | web.Response:
    """Every door's preamble: the request's arrival, id, tenant and body (its JSON object,
    as `read(request, limit, like)` reads it, default `read_json`, as `parse_body(payload,
    request)` reads it, e.g. `parse_input`); or, for a request refused here (bad id, unknown
    key, bad body), its error answer, recorded under `route`, its body in `shape` if given.
    `like` is the route's body in short, which a body that is not a JSON object is told to
    look like."""
    arrival = reception.clock.time()
    request_id, problem = request_id_of(request)
    tenant = None
    try:
        if problem is not None:
            raise problem
        tenant = caller_tenant(request, reception)
        payload = await (read or read_json)(request, reception.config.max_body_bytes, like)
        body = parse_body(payload, request)
    except BatchserveError as error:
        reception.record(route, request_id, arrival, error, tenant)
        return error_response(error, request_id, openai_shape=openai_shape, shape=shape)
    return Call(request_id, tenant, body, arrival, route)


def caller_tenant(request: web.BaseRequest, reception: Reception) -> Tenant | None:
    """Who is asking: the key's tenant (None on a server without keys), then, with
    --trust-gateway-headers, the tenant the inference gateway's headers name. Every door
    that files or finds a request by tenant asks this, so a request submitted through the
    gateway is found again the same way."""
    tenant = None
    config = reception.config
    if config.keys_file:  # else it runs open: no key to look for
        tenant = reception.authenticate(request.headers.get("Authorization"))
    if config.trust_gateway_headers:
        tenant = reception.gateway_tenant(request.headers, tenant)
    return tenant


def request_id_of(request: web.BaseRequest) -> tuple[str, InvalidInput | None]:
    """The client's X-Request-Id, or a fresh one; an unusable id is replaced, never echoed."""
    return request_id_in(request.headers)


def request_id_in(headers: Mapping[str, str]) -> tuple[str, InvalidInput | None]:
    """`request_id_of` from a request's headers (a head not yet a request has only them)."""
    given = headers.get("X-Request-Id")
    if not given:
        return new_request_id(), None
    if len(given) > MAX_REQUEST_ID or not given.isprintable():
        problem = InvalidInput(
            f"X-Request-Id must be at most {MAX_REQUEST_ID} printable characters"
        )
        return new_request_id(), problem
    return given, None


async def read_json(request: web.BaseRequest, limit: int, like: str) -> dict[str, Any]:
    """The body as a JSON object, within `limit` bytes; `like`: see `json_object`."""
    body = arrived_body(request, limit)  # no coroutine awaited for a body already here
    return json_object(await read_bytes(request, limit) if body is None else body, like)


def arrived_body(request: web.BaseRequest, limit: int) -> bytes | None:
    """The body if all of it has arrived, as a small body has by the time its handler
    runs: taken as it is, without `read`'s copies and two waits for more (3 % of the
    server's CPU a request, benchmarks/README.md, section 4); None if more is to come."""
    length = request.content_length  # parsed from the header at each read
    if length is not None and length > limit:
        raise too_large(limit)
    content = request.content
    if not content.is_eof() or content.exception() is not None:
        return None
    body = content.read_nowait()
    if len(body) > limit:
        raise too_large(limit)
    return body


async def read_bytes(request: web.BaseRequest, limit: int) -> bytes:
    """The body, within `limit` bytes."""
    body = arrived_body(request, limit)
    if body is not None:
        return body
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limit) from None
    except web.RequestPayloadError as exc:
        # A body its Content-Encoding does not describe (gzip that is not gzip), or a
        # chunked body that breaks off: the client's fault, not the server's.
        raise InvalidInput(f"the body could not be read: {_last_line(exc)}") from None


def json_object(body: bytes, like: str) -> dict[str, Any]:
    """`body` as a JSON object; InvalidInput that says what is wrong if it is not one, and
    what the route's body looks like (`like`, an example of its JSON)."""
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(_json_problem(exc)) from None
    if not isinstance(payload, dict):
        raise InvalidInput(f"the body must be a JSON object like {like}")
    return payload


def _last_line(exc: BaseException) -> str:
    """aiohttp's payload errors read "400, message:\n  <what>"; the what, bounded."""
    lines = str(exc).strip().splitlines()
    return lines[-1].strip()[:200] if lines else type(exc).__name__


def too_large(limit: int) -> InputTooLarge:
    return InputTooLarge(f"the body is over the limit of {limit} bytes")


def parse_input(payload: dict[str, Any], request: web.BaseRequest) -> Ask:
    """The body's input text, its model, version and params, and the request's own timeout
    in ms (None: the server's).

    Only the shape is checked here; the engine checks the input's size and text, routes the
    model and checks the params against it, and caps the timeout, for library callers as
    for HTTP ones.
    """
    text = payload.get("input")
    if len(payload) == 1 and isinstance(text, str) and TIMEOUT_HEADER not in request.headers:
        return Ask(text)  # {"input": "..."} alone, the common body: nothing more to read
    refuse_unknown_fields(payload, _BODY_FIELDS)
    if not isinstance(text, str):
        raise InvalidInput('the body needs a string field "input"')
    timeout_ms = timeout_ms_of(payload.get("timeout_ms"), request)
    if len(payload) == 1 or (len(payload) == 2 and "timeout_ms" in payload):
        return Ask(text, timeout_ms)
    return Ask(text, timeout_ms, *model_fields(payload))


def refuse_unknown_fields(payload: dict[str, Any], known: frozenset[str]) -> None:
    unknown = payload.keys() - known
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))[:200]}")


def model_fields(payload: dict[str, Any]) -> tuple[str | None, str | None, dict[str, Any] | None]:
    """The optional "model", "version" and "params" of a body, checked for shape."""
    model, version, params = payload.get("model"), payload.get("version"), payload.get("params")
    for name, value in (("model", model), ("version", version)):
        if value is not None and not isinstance(value, str):
            raise InvalidInput(f'"{name}" must be a string')
    if params is not None and not isinstance(params, dict):
        raise InvalidInput('"params" must be a JSON object')
    return model, version, params


def cache_salt_of(payload: dict[str, Any]) -> str | None:
    """vLLM's per-request `cache_salt`: a non-empty string; only requests with the same one
    share cached prefixes (null: none)."""
    salt = payload.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidInput('"cache_salt" must be a non-empty string')
    return salt


CACHE_SALT_SCHEMA = {
    "type": ["string", "null"],
    "minLength": 1,
    "description": "only requests with the same salt share cached prefixes (vLLM's)",
}


def _json_problem(exc: orjson.JSONDecodeError) -> str:
    """orjson's words for bad UTF-8 ("surrogates not allowed") mislead; say what is wrong."""
    if "not valid UTF-8" in exc.msg:
        return "the body is not valid UTF-8 text"
    if "surrogate" in exc.msg:
        return (
            f"the body is not valid UTF-8 JSON: the \\u escape before char {exc.pos} is half"
            " of a UTF-16 surrogate pair, which is not Unicode text"
        )
    return f"the body is not valid UTF-8 JSON: {exc}"


def timeout_ms_of(in_body: object, request: web.BaseRequest) -> float | None:
    """The request's own timeout: the body's, else the header's, else None."""
    requested: object = in_body
    if TIMEOUT_HEADER in request.headers:
        # Checked even where the body's wins: a bad header is refused, never ignored.
        try:
            in_header = float(request.headers[TIMEOUT_HEADER])
        except ValueError:
            raise InvalidInput(f"{TIMEOUT_HEADER} must be a number") from None
        try:
            checked_timeout_ms(in_header)
        except InvalidInput:
            raise InvalidInput(f"{TIMEOUT_HEADER} must be a number above 0") from None
        if requested is None:
            requested = in_header
    return None if requested is None else checked_timeout_ms(requested)


def answer_body(request_id: str, result: Result, latency_s: float) -> dict[str, Any]:
    # Milliseconds to 3 decimals as round(s * 1e3, 3) gives them, at half its cost: a whole
    # number of microseconds over 1e3 is the nearest float to that decimal.
    return {
        "output": result.output,
        "model": result.model,
        "version": result.version,
        "request_id": request_id,
        "latency_ms": round(latency_s * 1e6) / 1e3,
        "queue_ms": round(result.queue_s * 1e6) / 1e3,
        "compute_ms": round(result.compute_s * 1e6) / 1e3,
        "batch_size": result.batch_size,
    }


def answer_response(request_id: str, result: Result, latency_s: float) -> web.Response:
    """A 200 with `result`'s answer, its timings again as Server-Timing (ms) for browsers'
    and proxies' tools; built in one go, since every answered request passes here."""
    body = answer_body(request_id, result, latency_s)
    headers = {
        "Content-Type": "application/json",
        # Fixed decimals, which format in half the time of the floats' shortest forms.
        "Server-Timing": f"queue;dur={body['queue_ms']:.3f}, compute;dur={body['compute_ms']:.3f}",
        "X-Request-Id": request_id,
    }
    return web.Response(body=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), headers=headers)


def error_body(error: BatchserveError, request_id: str) -> dict[str, Any]:
    return {"error": error.code, "message": str(error), "request_id": request_id}


_JSON_TYPE = {"Content-Type": "application/json"}


def json_response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> web.Response:
    """The Content-Type goes in with the other headers: aiohttp's `content_type` argument
    parses the header it sets, and each header set after construction is another call."""
    return web.Response(
        status=status,
        body=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        headers=_JSON_TYPE if headers is None else _JSON_TYPE | headers,
    )


def status_response(
    status: int, message: str, request_id: str, headers: dict[str, str] | None = None
) -> web.Response:
    """An error answer for a status outside the error tree (aiohttp's own refusals, a
    server fault), in the same shape: its code is the status's name (UNSUPPORTED_MEDIA_TYPE)."""
    body = {"error": HTTPStatus(status).name, "message": message, "request_id": request_id}
    return json_response(status, body, {"X-Request-Id": request_id, **(headers or {})})


def error_response(
    error: BatchserveError,
    request_id: str,
    *,
    openai_shape: bool = False,
    shape: ErrorShape | None = None,
) -> web.Response:
    """The error's status, body and headers; `openai_shape` nests the body as OpenAI's API
    does ({"error": {"message", "type", "param", "code"}}, its type one of OpenAI's), which
    its client libraries parse; `shape` makes another protocol's body (`error_body`'s by
    default)."""
    body = error_body(error, request_id) if shape is None else shape(error, request_id)
    if openai_shape:
        body = {"error": openai_error(error), "request_id": request_id}
    headers = {"X-Request-Id": request_id}
    if isinstance(error, Overloaded | RateLimited | NotReady) and error.retry_after_s:
        body["retry_after_ms"] = max(1, round(error.retry_after_s * 1e3))
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    if isinstance(error, RateLimited):
        headers["RateLimit-Limit"] = f"{error.limit:g}"
        headers["RateLimit-Remaining"] = "0"
        headers["RateLimit-Reset"] = str(max(1, math.ceil(error.reset_s)))
    if isinstance(error, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(error, MethodNotAllowed):
        headers["Allow"] = ", ".join(error.allowed)
    return json_response(error.status, body, headers)


INFERENCE_BODY = {
    "title": "InferenceRequest",
    "type": "object",
    "required": ["input"],
    "additionalProperties": False,
    "properties": {
        "input": {"type": "string", "description": "up to --max-input-bytes of UTF-8"},
        "timeout_ms": {"type": ["number", "null"], "exclusiveMinimum": 0,
                       "description": "the request's own timeout, capped by --timeout-ms"},
        "model": ModelName("batch", "needed where several run", nullable=True),
        "version": {"type": ["string", "null"], "description": "pins a version"},
        "params": {"type": ["object", "null"],
                   "description": "keyword arguments the model's function takes; others: 400"},
    },
}  # fmt: skip
"""`parse_input`'s body, for the OpenAPI document."""
INFERENCE_ANSWER = {
    "title": "InferenceAnswer",
    "type": "object",
    "required": ["output", "model", "version", "request_id", "latency_ms", "queue_ms",
                 "compute_ms", "batch_size"],
    "properties": {
        "output": {"description": "what the batch function returned for this input"},
        "model": {"type": "string"},
        "version": {"type": "string"},
        "request_id": {"type": "string"},
        "latency_ms": {"type": "number", "minimum": 0},
        "queue_ms": {"type": "number", "minimum": 0},
        "compute_ms": {"type": "number", "minimum": 0},
        "batch_size": {"type": "integer", "minimum": 1},
    },
}  # fmt: skip
"""`answer_body`, for the OpenAPI document."""


def openai_error(error: BatchserveError) -> dict[str, Any]:
    """OpenAI's error object for `error`: every OpenAI-shaped answer, stream event and batch
    line's body uses this one."""
    return {"message": str(error), "type": _openai_type(error.status), "param": None,
            "code": error.code}  # fmt: skip


def _openai_type(status: int) -> str:
    """OpenAI's error type for a status: what its clients and dashboards group errors by."""
    if status == 429:
        return "requests"  # OpenAI's type for a request-rate limit
    if status >= 500:
        return "server_error"
    return "invalid_request_error"
