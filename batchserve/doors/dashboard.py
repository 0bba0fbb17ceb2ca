"""The operator's views: a live page at /, its numbers at /api/stats, Prometheus at /metrics.

The page is static HTML with a vendored, pinned chart library (uPlot, from npm); it polls
/api/stats once a second. No build step. The vendored files are served by name, one route
each, so a wrong path gets the API's JSON 404 like any other. With API keys, the numbers
(/api/stats, /metrics) need an operator key (`authorize`); the page and its script hold
none, and ask for the key when /api/stats answers 401.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import BatchserveError
from ..observability.exposition import TextExposition
from ..observability.metrics import Metrics
from .openapi import Answer, Operation, errors, json_answer
from .wire import error_response, json_response, request_id_of

STATIC_DIR = Path(__file__).parent / "static"


class Dashboard:
    vendor_files: ClassVar[dict[str, str]] = {
        "uPlot.iife.min.js": "text/javascript",
        "uPlot.min.css": "text/css",
    }
    """Each vendored file and its type, stated here (RFC 9239's text/javascript) rather than
    guessed by aiohttp, so that /openapi.json says what is served."""

    def __init__(
        self,
        metrics: Metrics,
        authorize: Callable[[str | None], None] = lambda _: None,
        *,
        now: Callable[[], float] = lambda: 0.0,
        max_age_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """`now`: the engine's clock; `max_age_s`: how old /metrics' families other than
        the picker's may be (--metrics-max-age-ms, read at each scrape so that a reload
        applies). The defaults render everything at every scrape."""
        self._metrics = metrics
        self._authorize = authorize
        self._now = now
        self._exposition = TextExposition(metrics.registry, max_age_s)
        self._picker_exposition = TextExposition(metrics.picker_registry)

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "dashboard.html")

    async def vendor_file(self, request: web.Request) -> web.FileResponse:
        name = Path(request.path).name
        return web.FileResponse(
            STATIC_DIR / "vendor" / name, headers={"Content-Type": self.vendor_files[name]}
        )

    async def stats(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        return json_response(200, self._metrics.snapshot())

    async def scrape(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        body = self._exposition.render(self._now())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def scrape_picker(self, request: web.Request) -> web.Response:
        """The inference gateway picker's gauges alone (its `--model-server-metrics-path`)."""
        if (refused := self._refused(request)) is not None:
            return refused
        body = self._picker_exposition.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _refused(self, request: web.Request) -> web.Response | None:
        try:
            self._authorize(request.headers.get("Authorization"))
        except BatchserveError as error:
            return error_response(error, request_id_of(request)[0])
        return None


PAGE = Operation(
    summary="The live dashboard",
    tag="operator",
    answers={200: Answer(description="the page", schema={"type": "string"},
                         media_type="text/html")},
)  # fmt: skip


def vendor_file_operation(name: str, kind: str) -> Operation:
    """GET /static/vendor/{name}: a vendored file of the page (uPlot), of type `kind`."""
    return Operation(
        summary=f"The dashboard's {name}",
        tag="operator",
        answers={200: Answer(description="the file", schema={"type": "string"}, media_type=kind)},
    )


STATS = Operation(
    summary="The dashboard's numbers",
    tag="operator",
    answers={200: json_answer("the numbers", {"type": "object"}), **errors(401)},
    auth="operator",
)
SCRAPE = Operation(
    summary="Prometheus metrics",
    tag="operator",
    answers={
        200: Answer(
            description="the exposition", schema={"type": "string"}, media_type="text/plain"
        ),
        **errors(401),
    },
    auth="operator",
)
SCRAPE_PICKER = Operation(
    summary="The inference gateway picker's gauges (Prometheus text)",
    tag="operator",
    answers={
        200: Answer(
            description="requests waiting and running, and utilisation, under batchserve's"
            " and vLLM's names",
            schema={"type": "string"},
            media_type="text/plain",
        ),
        **errors(401),
    },
    auth="operator",
)
