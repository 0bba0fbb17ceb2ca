"""The server's runner: aiohttp's, whose server hands `POST /api/inference` to its door
before aiohttp's routing, with this package's connections; and the answers that no route
gives (no such route, `Expect: 100-continue`, a head refused before its body).

The fast paths, both kept because a same-run A/B shows they pay (benchmarks/README.md,
section 4c: server CPU a request in process, with each taken out in turn): `AppRunner` hands
`POST /api/inference` to its door before aiohttp's router (7.7 % of the server's CPU a
request), and the inference door (`inference_api.py`) runs the engine's `infer` in its
parts (3 %). aiohttp has no public hook to choose a server's protocol (`connections.py`'s
deadlines and body budget need one) or to route before its router:
`AppRunner._make_server` is the one private method overridden, with aiohttp pinned to its
minor version.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import hdrs, web

from ..errors import BatchserveError, InputTooLarge, MethodNotAllowed, NotFound, Unauthenticated
from .admin_api import ROUTE as ADMIN_ROUTE
from .admin_api import authorize
from .connections import Connection, ConnectionServer
from .face import Reception
from .inference_api import InferenceApi
from .wire import error_response, request_id_of, status_response, too_large

RECEPTION_KEY: web.AppKey[Reception] = web.AppKey("batchserve_reception")
"""The engine, as the runner's server asks it: the settings and who is calling."""
INFERENCE_KEY: web.AppKey[InferenceApi] = web.AppKey("batchserve_inference")
"""The app's inference door, which `AppRunner`'s server calls without routing."""
INFERENCE_PATH = "/api/inference"
ADMIN_PREFIX = ADMIN_ROUTE.split("{", 1)[0]
MAX_PATH_SHOWN = 200
"""An unknown path is echoed in the error message up to this many characters."""


class AppRunner(web.AppRunner):
    """aiohttp's runner for an app of `create_app`, whose server hands `POST /api/inference`
    to the inference door itself, before aiohttp's routing: the resolve, match info and
    signals a request pass through there cost about 4 % of the server's CPU a request
    (benchmarks/README.md, section 4), and nearly every request takes that route. Any other
    request, and that one asking `Expect: 100-continue`, goes through the app's routing,
    which adds `X-Request-Id` to answers that lack it and writes aiohttp's own HTTP errors
    as the API's JSON. The door skips middlewares and `on_response_prepare`, so the app has
    none. Each connection is a `connections.Connection`: deadlines, the budget of unfinished
    bodies, and JSON for what aiohttp refuses before any handler runs."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        engine = self.app[RECEPTION_KEY]
        inference, routed = self.app[INFERENCE_KEY].inference, server.request_handler
        answer_routed = functools.partial(_answer_routed, routed)
        expecting = functools.partial(_expecting, engine, answer_routed)

        def handle(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
            # Not a coroutine: it hands on the handler's, one frame less per waiting request.
            if hdrs.EXPECT in request.headers:
                return expecting(request)
            if request.method == "POST" and request.raw_path == INFERENCE_PATH:
                return inference(request)
            return answer_routed(request)

        return ConnectionServer(
            handle,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            settings=lambda: engine.config,
            refused_by_head=functools.partial(refused_by_head, engine),
            **server._kwargs,
        )


async def _answer_routed(
    routed: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], request: web.BaseRequest
) -> web.StreamResponse:
    """A routed answer, with the request's `X-Request-Id` if its handler set none (a probe,
    a file, a listing); an HTTP error aiohttp raised, as the API's JSON error."""
    try:
        response = await routed(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            exc.headers.setdefault("X-Request-Id", request_id_of(request)[0])
            raise
        request_id = request_id_of(request)[0]
        if exc.status == 413:
            return error_response(InputTooLarge("the body is over the limit"), request_id)
        return status_response(exc.status, exc.reason, request_id)
    if not response.prepared and "X-Request-Id" not in response.headers:
        response.headers["X-Request-Id"] = request_id_of(request)[0]
    return response


async def _expecting(
    engine: Reception,
    answer_routed: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
    request: web.BaseRequest,
) -> web.StreamResponse:
    """`Expect: 100-continue`: a request whose answer is known from its head alone (its
    Content-Length over the limit, no valid key) gets that answer instead of 100 Continue,
    and its connection closes, the body unsent; the rest are routed, and the routing sends
    100 Continue."""
    request_id = request_id_of(request)[0]
    refusal: web.Response
    if request.headers[hdrs.EXPECT].lower() != "100-continue":
        refusal = status_response(417, "the only expectation met is 100-continue", request_id)
    else:
        error = refused_by_head(engine, request.path, request.headers)
        if error is None:
            return await answer_routed(request)
        refusal = error_response(error, request_id)
    refusal.force_close()
    if isinstance(request.protocol, Connection):
        request.protocol.drop_body()
    return refusal


def refused_by_head(
    engine: Reception, path: str, headers: Mapping[str, str]
) -> BatchserveError | None:
    """What a request whose body is yet to come is refused for before any of it is read:
    413 for a Content-Length over the limit, 401 for a missing or unknown key (the admin key
    on the admin routes). Asked for `Expect: 100-continue`, and by each connection before a
    body still arriving takes any of the budget of unfinished bodies (keys first)."""
    config = engine.config
    length = headers.get(hdrs.CONTENT_LENGTH)
    if length is not None and int(length) > config.max_body_bytes:
        return too_large(config.max_body_bytes)
    authorization = headers.get("Authorization")
    try:
        if path.startswith(ADMIN_PREFIX) and config.admin_key:
            authorize(authorization, config.admin_key.encode())
        elif config.keys_file:
            engine.authenticate(authorization)
    except Unauthenticated as error:
        return error
    return None


async def no_route(request: web.Request) -> web.Response:
    """404, or 405 with Allow when the path exists under other methods."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    path = request.path[:MAX_PATH_SHOWN]
    error: BatchserveError
    if allowed:
        methods = sorted(allowed)
        error = MethodNotAllowed(
            f"{request.method} is not allowed on {path}; use {', '.join(methods)}", methods
        )
    else:
        error = NotFound(f"no route {path}; GET /openapi.json lists the routes")
    return error_response(error, request_id_of(request)[0])
