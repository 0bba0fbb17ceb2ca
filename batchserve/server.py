"""The HTTP door onto the engine: parse, call the engine, write the answer.

`create_app` mounts the doors over one `Engine`: this module's inference and health routes,
generation (`generate_api.py`), the OpenAI-shaped routes (`openai_api.py`,
`openai_completions.py`), the status API (`status_api.py`) and the dashboard
(`dashboard.py`). Each is handed only what
it needs; none holds another's object. The app's cleanup context starts the engine and, at
shutdown, drains and stops it. Every path or method that no route serves gets the same JSON
error body and `X-Request-Id` as any other answer. `AppRunner` serves such an app with the
inference door ahead of aiohttp's routing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable

from aiohttp import hdrs, web

from .admin_api import ROUTE as ADMIN_ROUTE
from .admin_api import AdminApi
from .dashboard import Dashboard
from .engine import Engine
from .errors import BatchserveError, MethodNotAllowed, NotFound
from .generate_api import GenerateApi
from .http_io import (
    answer_response,
    error_response,
    json_response,
    parse_input,
    read_call,
    request_id_of,
)
from .item import Result
from .openai_api import OpenAIApi
from .openai_completions import OpenAICompletionsApi
from .status_api import StatusApi

ENGINE_KEY: web.AppKey[Engine] = web.AppKey("batchserve_engine")
INFERENCE_KEY: web.AppKey[InferenceApi] = web.AppKey("batchserve_inference")
"""The app's inference door, which `AppRunner`'s server calls without routing."""
INFERENCE_PATH = "/api/inference"
MAX_PATH_SHOWN = 200
"""An unknown path is echoed in the error message up to this many characters."""


class InferenceApi:
    """POST /api/inference, and the probes a load balancer asks."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def inference(self, request: web.BaseRequest) -> web.Response:
        engine = self._engine
        arrival = engine.clock.time()
        call = await read_call(request, engine, "inference", arrival, parse_input)
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
        return json_response(200, {"models": self._engine.models()})

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response(200, {"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready while serving with at least one healthy device; lists each device."""
        ready, status = self._engine.readiness()
        body = {"status": status, "devices": self._engine.device_states()}
        return json_response(200 if ready else 503, body)


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
    app[INFERENCE_KEY] = inference = InferenceApi(engine)
    app.router.add_post(INFERENCE_PATH, inference.inference)
    app.router.add_get("/api/models", inference.models)
    app.router.add_get("/healthz", inference.healthz)
    app.router.add_get("/readyz", inference.readyz)
    openai = OpenAIApi(engine)
    app.router.add_post("/v1/embeddings", openai.embeddings)
    app.router.add_get("/v1/models", openai.models)
    completions = OpenAICompletionsApi(engine)
    app.router.add_post("/v1/completions", completions.completions)
    app.router.add_post("/v1/chat/completions", completions.chat_completions)
    app.router.add_post("/api/generate", GenerateApi(engine).generate)
    if engine.config.admin_key:
        admin = AdminApi(engine, engine.config.admin_key)
        app.router.add_put(ADMIN_ROUTE, admin.put)
        app.router.add_patch(ADMIN_ROUTE, admin.patch)
        app.router.add_delete(ADMIN_ROUTE, admin.delete)
    status_api = StatusApi(engine)
    app.cleanup_ctx.append(status_api.lifespan)  # after the engine's: it submits at start
    app.router.add_post("/api/requests", status_api.submit)
    app.router.add_get("/api/requests/{request_id}", status_api.poll)
    if engine.metrics is not None:
        dashboard = Dashboard(engine.metrics, engine.authorize_operator)
        app.router.add_get("/", dashboard.page)
        app.router.add_get("/api/stats", dashboard.stats)
        app.router.add_get("/metrics", dashboard.scrape)
        for name in dashboard.vendor_files:
            app.router.add_get(f"/static/vendor/{name}", dashboard.vendor_file)
    # Last, so that it only gets what no route above serves (aiohttp's own 404 and 405 are
    # plain text); a route on the hot path pays nothing for it, unlike a middleware.
    app.router.add_route("*", "/{path:.*}", _no_route)
    return app


class AppRunner(web.AppRunner):
    """aiohttp's runner for an app of `create_app`, whose server hands `POST /api/inference`
    to the inference door itself, before aiohttp's routing: the resolve, match info and
    signals a request pass through there cost about 4 % of the server's CPU a request
    (benchmarks/README.md, section 4), and nearly every request takes that route. Any other
    request, and that one with a query string or asking `Expect: 100-continue` (which the
    routing answers), goes through the app's routing as before. The door skips middlewares
    and `on_response_prepare`, so the app has none."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        inference, routed = self.app[INFERENCE_KEY].inference, server.request_handler

        def handle(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
            # Not a coroutine: it hands on the handler's, one frame less per waiting request.
            if (
                request.method == "POST"
                and request.raw_path == INFERENCE_PATH
                and hdrs.EXPECT not in request.headers
            ):
                return inference(request)
            return routed(request)

        server.request_handler = handle
        return server


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
