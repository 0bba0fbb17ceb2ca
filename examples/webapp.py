"""Your own web app with batchserve inside it: no second process and no HTTP hop between
them. Concurrent requests to /shout are batched together by the embedded engine, exactly as
batchserve's own HTTP server batches them.

    python examples/webapp.py          # then: curl 'localhost:8080/shout?text=hello'
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

import batchserve
from batchserve.errors import BatchserveError

ENGINE = web.AppKey("engine", batchserve.Engine)


def shout(inputs: list[str]) -> list[str]:
    """The model: called with a batch of inputs, on the engine's device thread."""
    return [text.upper() for text in inputs]


async def engine_lifespan(app: web.Application) -> AsyncIterator[None]:
    """The engine starts with the app and, at shutdown, answers what it accepted first."""
    config = batchserve.Config(max_batch_size=64, max_linger_ms=5, timeout_ms=2000)
    async with batchserve.Engine(config, fn=shout, devices="cpu") as engine:
        app[ENGINE] = engine
        yield


async def shout_handler(request: web.Request) -> web.Response:
    try:
        result = await request.app[ENGINE].infer(request.query.get("text", ""))
    except BatchserveError as error:  # each carries its HTTP status and code
        return web.json_response({"error": error.code, "message": str(error)}, status=error.status)
    return web.json_response({"shouted": result.output, "batch_size": result.batch_size})


def make_app() -> web.Application:
    app = web.Application()
    app.cleanup_ctx.append(engine_lifespan)
    app.router.add_get("/shout", shout_handler)
    return app


if __name__ == "__main__":
    web.run_app(make_app(), host="127.0.0.1", port=8080)
