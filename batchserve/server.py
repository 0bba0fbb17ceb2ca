"""The HTTP door onto the engine: parse, call the engine, write the answer.

`create_app` mounts the doors over one `Engine`: this module's inference and health routes,
generation (`doors/generate_api.py`), the OpenAI-shaped routes (`doors/openai_api.py`,
`doors/openai_completions.py`), KServe's Open Inference Protocol (`doors/oip.py`), the status
API (`doors/status_api.py`) and the dashboard (`doors/dashboard.py`). Each is handed only what
it needs; none holds another's object. The app's cleanup context starts the engine and, at
shutdown, drains and stops it. Every path or method that no route serves gets the same JSON
error body and `X-Request-Id` as any other answer. `AppRunner` serves such an app with the
inference door ahead of aiohttp's routing.

The fast paths, both here and kept because a same-run A/B shows they pay (benchmarks/README.md,
section 4c: server CPU a request in process, with each taken out in turn): `AppRunner` hands
`POST /api/inference` to its door before aiohttp's router (7.7 % of the server's CPU a
request), and `InferenceApi.inference` runs `Engine.infer` in its parts (admit, await,
settle) so that no coroutine or parsed call outlives the admission (3 %). aiohttp has no
public hook to choose a server's protocol (`doors/connections.py`'s deadlines and body
budget need one) or to route before its router: `AppRunner._make_server` is the one
private method overridden, with aiohttp pinned to its minor version.

Over 400 lines because the app is assembled here, every door mounted in one place with its
OpenAPI operation, beside the fast door and the runner that the fast paths need.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from aiohttp import hdrs, web

from . import __version__
from .batching.request import Result
from .config import Config
from .doors.admin_api import ADMIN_DELETE, ADMIN_PATCH, ADMIN_PUT, AdminApi, authorize
from .doors.admin_api import ROUTE as ADMIN_ROUTE
from .doors.batch_api import mount_batches
from .doors.connections import Connection, ConnectionServer
from .doors.dashboard import (
    PAGE,
    SCRAPE,
    SCRAPE_PICKER,
    STATS,
    Dashboard,
    vendor_file_operation,
)
from .doors.generate_api import GenerateApi, generate_operation
from .doors.oip import OipApi
from .doors.openai_api import EMBEDDINGS, OPENAI_MODEL, OPENAI_MODELS, OpenAIApi
from .doors.openai_completions import OpenAICompletionsApi, completion_operation
from .doors.openapi import (
    REQUEST_ID,
    TIMEOUT,
    Kind,
    LiveModels,
    Operation,
    Routes,
    Security,
    errors,
    json_answer,
)
from .doors.retrieval_api import RetrievalApi
from .doors.retrieval_schemas import OPERATIONS as RETRIEVAL_OPERATIONS
from .doors.status_api import POLL, SUBMIT, StatusApi
from .doors.tei_bodies import Plan
from .doors.wire import (
    INFERENCE_ANSWER,
    INFERENCE_BODY,
    INPUT_LIKE,
    Call,
    ErrorShape,
    answer_response,
    error_response,
    json_response,
    parse_input,
    read_call,
    request_id_of,
    status_response,
    too_large,
)
from .engine.core import Engine
from .errors import (
    BatchserveError,
    InputTooLarge,
    MethodNotAllowed,
    NotFound,
    Unauthenticated,
)

ENGINE_KEY: web.AppKey[Engine] = web.AppKey("batchserve_engine")
INFERENCE_KEY: web.AppKey[InferenceApi] = web.AppKey("batchserve_inference")
"""The app's inference door, which `AppRunner`'s server calls without routing."""
ROUTES_KEY: web.AppKey[Routes] = web.AppKey("batchserve_routes")
"""The app's routes and their operations, which /openapi.json describes."""
INFERENCE_PATH = "/api/inference"
ADMIN_PREFIX = ADMIN_ROUTE.split("{", 1)[0]
MAX_PATH_SHOWN = 200
"""An unknown path is echoed in the error message up to this many characters."""


class InferenceApi:
    """POST /api/inference, and the probes a load balancer asks. `store_problem` says why
    the result store cannot be used now (None while it can), for /readyz."""

    def __init__(
        self, engine: Engine, store_problem: Callable[[], Awaitable[str | None]] | None = None
    ) -> None:
        self._engine = engine
        self._store_problem = store_problem

    async def inference(self, request: web.BaseRequest) -> web.Response:
        engine = self._engine
        arrival = engine.clock.time()
        call = await read_call(request, engine, "inference", arrival, parse_input, like=INPUT_LIKE)
        if isinstance(call, web.Response):
            return call
        request_id, tenant, ask = call
        # `engine.infer` in parts (admit, await, settle), and nothing more bound than the
        # request: each object a request keeps for its wait, `infer`'s coroutine as much as
        # the parsed call, costs the loop (benchmarks/README.md, section 4).
        del call
        try:
            queued, expiry = engine.admit("inference", ask, request_id, tenant, arrival)
        except BatchserveError as error:
            return error_response(error, request_id)
        del ask
        outcome: Result | BatchserveError | None = None
        try:
            outcome = result = await queued.future
        except BatchserveError as error:
            outcome = error
            return error_response(error, request_id)
        finally:
            engine.settle("inference", queued, expiry, tenant, outcome)
        return answer_response(request_id, result, engine.clock.time() - arrival)

    async def models(self, request: web.Request) -> web.Response:
        """GET /api/models: each model, its versions, devices, weights and state; with
        API keys, for a caller with a key (or the anonymous tier)."""
        try:
            self._engine.authenticate(request.headers.get("Authorization"))
        except BatchserveError as error:
            return error_response(error, request_id_of(request)[0])
        return json_response(200, {"models": self._engine.view.models()})

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response(200, {"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready while serving with at least one healthy device and a result store that
        answers; lists each device, and the store's problem if it has one."""
        ready, status = self._engine.readiness()
        body: dict[str, object] = {"status": status, "devices": self._engine.device_states()}
        if ready and self._store_problem is not None:
            problem = await self._store_problem()
            if problem is not None:
                ready = False
                body.update(status="result store unavailable", result_store=problem)
        return json_response(200 if ready else 503, body)


INFERENCE = Operation(
    summary="Run one input through a model, answered on the same connection",
    tag="inference",
    parameters=(REQUEST_ID, TIMEOUT),
    body=INFERENCE_BODY,
    answers={
        200: json_answer("the model's output and timings", INFERENCE_ANSWER, "Server-Timing"),
        **errors(400, 401, 404, 409, 413, 429, 500, 503, 504),
    },
    auth="key",
)
MODEL_LIST = {
    "title": "ModelList",
    "type": "object",
    "required": ["models"],
    "properties": {"models": {"type": "array", "items": {
        "type": "object",
        "required": ["name", "versions"],
        "properties": {"name": {"type": "string"}, "versions": {"type": "array", "items": {
            "type": "object",
            "required": ["version", "state", "kind"],
            "properties": {"version": {"type": "string"}, "state": {"type": "string"},
                           "kind": {"enum": ["batch", "generation"]}},
        }}},
    }}},
}  # fmt: skip
MODELS = Operation(
    summary="Each model, its versions, devices, weights and state",
    tag="models",
    answers={200: json_answer("the models", MODEL_LIST), **errors(401)},
    auth="key",
)
HEALTHZ = Operation(
    summary="Liveness: the process answers",
    tag="health",
    answers={200: json_answer("alive", {"type": "object", "properties": {
        "status": {"const": "alive"}}, "required": ["status"]})},
)  # fmt: skip
_READINESS = {
    "title": "Readiness",
    "type": "object",
    "required": ["status", "devices"],
    "properties": {
        "status": {"type": "string"},
        "devices": {"type": "object", "additionalProperties": {"type": "string"},
                    "description": "each device's state"},
        "result_store": {"type": "string", "description": "why the result store fails"},
    },
}  # fmt: skip
READYZ = Operation(
    summary="Readiness: serving, with a healthy device and a result store that answers",
    tag="health",
    answers={200: json_answer("ready", _READINESS), 503: json_answer("not ready", _READINESS)},
)
OPENAPI = Operation(
    summary="This document: every route this server mounted, its body and answers",
    tag="health",
    answers={200: json_answer("the OpenAPI 3.1 document", {"type": "object"})},
)


def _security(config: Config) -> Security:
    keys = config.keys_file is not None
    return Security(
        key=keys,
        anonymous=keys and config.anonymous_tier is not None,
        admin=bool(config.admin_key),
        operator=keys and not config.public_metrics,
    )


def _may_see_models(engine: Engine, authorization: str | None) -> bool:
    """Whether a caller may see the model names in /openapi.json: as /api/models shows
    them, to anyone on a server without keys, else with a key (or the anonymous tier)."""
    try:
        engine.authenticate(authorization)
    except BatchserveError:
        return False
    return True


def _live_models(engine: Engine) -> LiveModels:
    def names(kind: Kind) -> list[str]:
        batch = kind if kind != "embedding" else "batch"
        named = [
            model["name"]
            for model in engine.view.models()
            if any(version["kind"] == batch for version in model["versions"])
        ]
        return named if kind != "embedding" else [n for n in named if _embeds(engine, n)]

    return names


def _embeds(engine: Engine, model: str) -> bool:
    try:
        engine.view.embedding_dim(model)
    except BatchserveError:
        return False
    return True


def create_app(engine: Engine) -> web.Application:
    app = web.Application(client_max_size=engine.config.max_body_bytes)
    app[ENGINE_KEY] = engine

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup_ctx: devices load first and close last."""
        async with engine:
            yield

    async def drain_on_shutdown(app: web.Application) -> None:
        """aiohttp has stopped the sites and told each connection to close after the request
        in hand when this runs, so what still arrives was sent before: served, not refused."""
        await engine.drain(refuse_new=False)

    app.cleanup_ctx.append(lifespan)
    app.on_shutdown.append(drain_on_shutdown)
    status_api = StatusApi(engine)
    app[INFERENCE_KEY] = inference = InferenceApi(engine, status_api.store_problem)
    app[ROUTES_KEY] = routes = Routes(
        app,
        _security(engine.config),
        "batchserve",
        __version__,
        _live_models(engine),
        lambda: [engine.view.embedding_dim(name) for name in _live_models(engine)("embedding")],
        functools.partial(_may_see_models, engine),
    )
    routes.add("POST", INFERENCE_PATH, inference.inference, INFERENCE)
    routes.add("GET", "/api/models", inference.models, MODELS)
    routes.add("GET", "/healthz", inference.healthz, HEALTHZ)
    routes.add("GET", "/readyz", inference.readyz, READYZ)
    routes.add("GET", "/openapi.json", routes.serve, OPENAPI)
    openai = OpenAIApi(engine)
    routes.add("POST", "/v1/embeddings", openai.embeddings, EMBEDDINGS)
    routes.add("GET", "/v1/models", openai.models, OPENAI_MODELS)
    routes.add("GET", "/v1/models/{model:.+}", openai.model, OPENAI_MODEL)
    OipApi(engine).mount(routes)
    _retrieval(engine).mount(
        lambda method, path, handler: routes.add(
            method, path, handler, RETRIEVAL_OPERATIONS[(method, path)]
        )
    )
    completions = OpenAICompletionsApi(engine)
    chat = completion_operation(engine.config, chat=True)
    routes.add(
        "POST",
        "/v1/completions",
        completions.completions,
        completion_operation(engine.config, chat=False),
    )
    routes.add("POST", "/v1/chat/completions", completions.chat_completions, chat)
    generate = GenerateApi(engine).generate
    routes.add("POST", "/api/generate", generate, generate_operation(engine.config))
    if engine.config.admin_key:
        admin = AdminApi(engine, engine.config.admin_key)
        routes.add("PUT", ADMIN_ROUTE, admin.put, ADMIN_PUT)
        routes.add("PATCH", ADMIN_ROUTE, admin.patch, ADMIN_PATCH)
        routes.add("DELETE", ADMIN_ROUTE, admin.delete, ADMIN_DELETE)
    app.cleanup_ctx.append(status_api.lifespan)  # after the engine's: it submits at start
    mount_batches(engine, routes.add, app.cleanup_ctx.append)
    routes.add("POST", "/api/requests", status_api.submit, SUBMIT)
    routes.add("GET", "/api/requests/{request_id}", status_api.poll, POLL)
    if engine.metrics is not None:
        dashboard = Dashboard(
            engine.metrics,
            engine.authorize_operator,
            now=lambda: engine.clock.time(),
            max_age_s=lambda: engine.config.metrics_max_age_ms / 1e3,
        )
        routes.add("GET", "/", dashboard.page, PAGE)
        routes.add("GET", "/api/stats", dashboard.stats, STATS)
        routes.add("GET", "/metrics", dashboard.scrape, SCRAPE)
        routes.add("GET", "/metrics/picker", dashboard.scrape_picker, SCRAPE_PICKER)
        for name, kind in dashboard.vendor_files.items():
            file = vendor_file_operation(name, kind)
            routes.add("GET", f"/static/vendor/{name}", dashboard.vendor_file, file)
    # Last, so that it only gets what no route above serves (aiohttp's own 404 and 405 are
    # plain text); a route on the hot path pays nothing for it, unlike a middleware.
    app.router.add_route("*", "/{path:.*}", _no_route)
    return app


def _retrieval(engine: Engine) -> RetrievalApi:
    """The retrieval door, handed the engine's methods it calls and nothing more."""

    def preamble(
        request: web.Request,
        route: str,
        arrival: float,
        parse_body: Callable[[dict[str, Any], web.Request], Plan],
        *,
        like: str,
        shape: ErrorShape | None = None,
    ) -> Awaitable[Call[Plan] | web.Response]:
        return read_call(request, engine, route, arrival, parse_body, like=like, shape=shape)

    return RetrievalApi(
        now=lambda: engine.clock.time(),
        preamble=preamble,
        infer_all=engine.infer_all,
        text_model=engine.view.text_model,
        dimensions=engine.view.dimensions,
        authenticate=engine.authenticate,
        max_inputs=lambda: engine.config.retrieval_max_inputs,
        version=__version__,
    )


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
        engine = self.app[ENGINE_KEY]
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
    engine: Engine,
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
    engine: Engine, path: str, headers: Mapping[str, str]
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


async def _no_route(request: web.Request) -> web.Response:
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
        error = NotFound(f"no route {path}; see README for the API")
    return error_response(error, request_id_of(request)[0])
