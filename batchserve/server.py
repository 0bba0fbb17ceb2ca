"""The app: every door mounted over one engine, each with its OpenAPI operation.

`create_app` mounts the doors: the inference door and the probes (`doors/inference_api.py`),
generation (`doors/generate_api.py`), the OpenAI-shaped routes (`doors/openai_api.py`,
`doors/openai_completions.py`), KServe's Open Inference Protocol (`doors/oip.py`), the status
API (`doors/status_api.py`), the admin API (`doors/admin_api.py`) and the dashboard
(`doors/dashboard.py`). Each door is handed the engine typed as the face it may ask
(`doors/face.py`), or the engine's part it uses; none holds another's object. The app's
cleanup context starts the engine and, at shutdown, drains and stops it. Every path or
method that no route serves gets the same JSON error body and `X-Request-Id` as any other
answer. `AppRunner` (`doors/runner.py`) serves such an app with the inference door ahead
of aiohttp's routing.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

from aiohttp import web

from . import __version__
from .config import Config
from .doors.admin_api import ADMIN_DELETE, ADMIN_PATCH, ADMIN_PUT, AdminApi
from .doors.admin_api import ROUTE as ADMIN_ROUTE
from .doors.batch_api import mount_batches
from .doors.dashboard import (
    PAGE,
    SCRAPE,
    SCRAPE_PICKER,
    STATS,
    Dashboard,
    vendor_file_operation,
)
from .doors.face import Reception, Views
from .doors.generate_api import GenerateApi, generate_operation
from .doors.inference_api import HEALTHZ, INFERENCE, MODELS, READYZ, InferenceApi
from .doors.oip import OipApi
from .doors.openai_api import EMBEDDINGS, OPENAI_MODEL, OPENAI_MODELS, OpenAIApi
from .doors.openai_completions import OpenAICompletionsApi, completion_operation
from .doors.openapi import Kind, LiveModels, Operation, Routes, Security, json_answer
from .doors.retrieval_api import RetrievalApi
from .doors.retrieval_schemas import OPERATIONS as RETRIEVAL_OPERATIONS
from .doors.runner import INFERENCE_KEY, INFERENCE_PATH, RECEPTION_KEY, AppRunner, no_route
from .doors.status_api import POLL, SUBMIT, StatusApi
from .engine.core import Engine
from .errors import BatchserveError

__all__ = ["ROUTES_KEY", "AppRunner", "create_app"]

ROUTES_KEY: web.AppKey[Routes] = web.AppKey("batchserve_routes")
"""The app's routes and their operations, which /openapi.json describes."""
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


def _may_see_models(engine: Reception, authorization: str | None) -> bool:
    """Whether a caller may see the model names in /openapi.json: as /api/models shows
    them, to anyone on a server without keys, else with a key (or the anonymous tier)."""
    try:
        engine.authenticate(authorization)
    except BatchserveError:
        return False
    return True


def _live_models(engine: Views) -> LiveModels:
    def names(kind: Kind) -> list[str]:
        batch = kind if kind != "embedding" else "batch"
        named = [
            model["name"]
            for model in engine.view.models()
            if any(version["kind"] == batch for version in model["versions"])
        ]
        return named if kind != "embedding" else [n for n in named if _embeds(engine, n)]

    return names


def _embeds(engine: Views, model: str) -> bool:
    try:
        engine.view.embedding_dim(model)
    except BatchserveError:
        return False
    return True


def create_app(engine: Engine) -> web.Application:
    app = web.Application(client_max_size=engine.config.max_body_bytes)
    app[RECEPTION_KEY] = engine

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
    retrieval = RetrievalApi(
        reception=engine,
        infer_all=engine.infer_all,
        text_model=engine.view.text_model,
        dimensions=engine.view.dimensions,
        max_inputs=lambda: engine.config.retrieval_max_inputs,
        version=__version__,
    )
    retrieval.mount(
        lambda method, path, handler: routes.add(
            method, path, handler, RETRIEVAL_OPERATIONS[(method, path)]
        )
    )
    completions = OpenAICompletionsApi(engine, engine.generation)
    chat = completion_operation(engine.config, chat=True)
    routes.add(
        "POST",
        "/v1/completions",
        completions.completions,
        completion_operation(engine.config, chat=False),
    )
    routes.add("POST", "/v1/chat/completions", completions.chat_completions, chat)
    generate = GenerateApi(engine, engine.generation).generate
    routes.add("POST", "/api/generate", generate, generate_operation(engine.config))
    if engine.config.admin_key:
        admin = AdminApi(
            engine.versions, engine.device_names, lambda: engine.config, engine.config.admin_key
        )
        routes.add("PUT", ADMIN_ROUTE, admin.put, ADMIN_PUT)
        routes.add("PATCH", ADMIN_ROUTE, admin.patch, ADMIN_PATCH)
        routes.add("DELETE", ADMIN_ROUTE, admin.delete, ADMIN_DELETE)
    app.cleanup_ctx.append(status_api.lifespan)  # after the engine's: it submits at start
    mount_batches(engine, engine.generation, routes.add, app.cleanup_ctx.append)
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
    app.router.add_route("*", "/{path:.*}", no_route)
    return app
