"""The operator's views: a live page at /, its numbers at /api/stats, Prometheus at /metrics.

The page is static HTML with a vendored, pinned chart library (uPlot, from npm); it polls
/api/stats once a second. No build step. The vendored files are served by name, one route
each, so a wrong path gets the API's JSON 404 like any other.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .http_io import json_response
from .metrics import Metrics

STATIC_DIR = Path(__file__).parent / "static"


class Dashboard:
    vendor_files = ("uPlot.iife.min.js", "uPlot.min.css")

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "dashboard.html")

    async def vendor_file(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "vendor" / Path(request.path).name)

    async def stats(self, request: web.Request) -> web.Response:
        return json_response(200, self._metrics.snapshot())

    async def scrape(self, request: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
