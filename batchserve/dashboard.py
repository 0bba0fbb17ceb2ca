"""The operator's views: a live page at /, its numbers at /api/stats, Prometheus at /metrics.

The page is static HTML with a vendored, pinned chart library (uPlot, from npm); it polls
/api/stats once a second. No build step.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .http_io import json_response
from .metrics import Metrics

if TYPE_CHECKING:
    from .server import Server


class Dashboard:
    static_dir = Path(__file__).parent / "static"

    def __init__(self, server: Server, metrics: Metrics) -> None:
        self._server = server
        self._metrics = metrics

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(self.static_dir / "dashboard.html")

    async def stats(self, request: web.Request) -> web.Response:
        return json_response(200, self._metrics.snapshot(self._server.loop.time()))

    async def scrape(self, request: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
