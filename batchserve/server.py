"""The HTTP contract: parses requests, holds the pending futures, maps errors to statuses.

`Server` owns the pending-futures dict (request id -> future), the lifecycle phase and, via
`lifespan`, the pool and the batcher, which it starts in order and stops in reverse.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from .backends import DeviceFactory
from .batcher import Batcher
from .config import Config
from .errors import (
    BackendError,
    BatchserveError,
    DeadlineExceeded,
    DuplicateRequestId,
    InputTooLarge,
    InvalidInput,
    NotReady,
    Overloaded,
)
from .faults import BatchBudget, RetryBudget
from .gpu_pool import GpuPool
from .item import QueuedRequest, Result
from .policy import make_policy

log = logging.getLogger(__name__)

SERVER_KEY: web.AppKey[Server] = web.AppKey("batchserve_server")

_STATUS: dict[type[BatchserveError], tuple[int, str]] = {
    InvalidInput: (400, "INVALID_INPUT"),
    DuplicateRequestId: (409, "DUPLICATE_REQUEST_ID"),
    InputTooLarge: (413, "INPUT_TOO_LARGE"),
    BackendError: (500, "BACKEND_ERROR"),
    Overloaded: (503, "OVERLOADED"),
    NotReady: (503, "NOT_READY"),
    DeadlineExceeded: (504, "DEADLINE_EXCEEDED"),
}
_BODY_FIELDS = frozenset({"input", "timeout_ms"})
_MAX_REQUEST_ID = 128


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


class Server:
    def __init__(self, config: Config, device_names: list[str], factory: DeviceFactory):
        self.config = config
        self.phase = Phase.STARTING
        self.pending: dict[str, asyncio.Future[Result]] = {}
        budget = BatchBudget(fixed_s=config.batch_timeout_ms / 1e3 or None)
        self.pool = GpuPool(device_names, factory, budget)
        self.batcher = Batcher(
            make_policy(config),
            self.pool,
            max_batch_size=config.max_batch_size,
            max_queue=config.max_queue,
            bisect_failures=config.bisect_failures,
            retry_budget=RetryBudget(
                ratio=config.retry_budget,
                reserve=config.retry_reserve,
                tokens=config.retry_reserve,
            ),
        )
        self.pool.listener = self.batcher
        self._drained: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"<Server {self.phase.value} pending={len(self.pending)}>"

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup_ctx: devices load first and close last."""
        # Kept: asyncio.get_running_loop() checks the pid with a syscall on every call.
        self._loop = asyncio.get_running_loop()
        async with self.pool, self.batcher:
            self.phase = Phase.READY
            yield
            await self.drain()

    async def drain(self) -> None:
        """Stops taking requests and answers every accepted one; safe to call twice."""
        if self._drained is None:
            self._drained = asyncio.create_task(self._drain())
        await asyncio.shield(self._drained)

    async def _drain(self) -> None:
        self.phase = Phase.DRAINING
        try:
            async with asyncio.timeout(self.config.drain_timeout_s):
                await self.batcher.wait_until(lambda s: s.queued == 0 and s.in_flight == 0)
        except TimeoutError:
            stopped = NotReady("the server shut down before this request could run")
            log.warning("drain timed out: answering %d requests 503", len(self.pending))
            self.batcher.fail_queued(stopped)
            self.pool.fail_in_flight(stopped)

    async def healthz(self, request: web.Request) -> web.Response:
        return _json(200, {"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready while not draining and at least one device is healthy; lists each device."""
        status = self.phase.value
        if self.phase is Phase.READY and not self.pool.healthy:
            status = "no healthy device"
        body = {"status": status, "devices": self.pool.states()}
        return _json(200 if status == Phase.READY.value else 503, body)

    async def inference(self, request: web.Request) -> web.Response:
        loop = self._loop
        assert loop is not None, "requests arrive only after lifespan started"
        arrival = loop.time()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            if len(request_id) > _MAX_REQUEST_ID or not request_id.isprintable():
                request_id = uuid.uuid4().hex
                raise InvalidInput(
                    f"X-Request-Id must be at most {_MAX_REQUEST_ID} printable characters"
                )
            if self.phase is not Phase.READY:
                raise NotReady(f"the server is {self.phase.value}")
            if not self.pool.healthy:
                raise NotReady("no device is healthy; see /readyz")
            text, timeout_s = await self._parse(request)
            if request_id in self.pending:
                raise DuplicateRequestId(f"request id {request_id} is already in flight")
            result = await self._run(loop, request_id, text, arrival, arrival + timeout_s)
        except BatchserveError as error:
            return _error(error, request_id)
        latency_ms = (loop.time() - arrival) * 1e3
        queue_ms, compute_ms = result.queue_s * 1e3, result.compute_s * 1e3
        response = _json(
            200,
            {
                "output": result.output,
                "request_id": request_id,
                "latency_ms": round(latency_ms, 3),
                "queue_ms": round(queue_ms, 3),
                "compute_ms": round(compute_ms, 3),
                "batch_size": result.batch_size,
            },
        )
        response.headers["Server-Timing"] = (
            f"queue;dur={queue_ms:.3f}, compute;dur={compute_ms:.3f}"
        )
        response.headers["X-Request-Id"] = request_id
        return response

    async def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        request_id: str,
        text: str,
        arrival: float,
        deadline: float,
    ) -> Result:
        future: asyncio.Future[Result] = loop.create_future()
        self.pending[request_id] = future
        # One timer that fails the future, rather than asyncio.timeout_at: the hot path then
        # needs no Timeout object, no task-cancel round trip and no extra loop lookups.
        expiry = loop.call_at(deadline, _expire, future)
        try:
            self.batcher.submit(QueuedRequest(request_id, text, arrival, deadline, future))
            return await future
        finally:
            expiry.cancel()
            del self.pending[request_id]
            self.batcher.discard(request_id)

    async def _parse(self, request: web.Request) -> tuple[str, float]:
        limit = self.config.max_body_bytes
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
        if size > self.config.max_input_bytes:
            raise InputTooLarge(
                f"the input is {size} bytes; the limit is {self.config.max_input_bytes}"
            )
        return text, self._timeout_s(payload.get("timeout_ms"), request)

    def _timeout_s(self, in_body: object, request: web.Request) -> float:
        """The request's own timeout (body first, then header), capped by the server's."""
        requested: object = in_body
        if requested is None and "X-Request-Timeout-Ms" in request.headers:
            try:
                requested = float(request.headers["X-Request-Timeout-Ms"])
            except ValueError:
                raise InvalidInput("X-Request-Timeout-Ms must be a number") from None
        cap = self.config.timeout_ms
        if requested is None:
            return cap / 1e3
        if (
            isinstance(requested, bool)
            or not isinstance(requested, int | float)
            or not math.isfinite(requested)
            or requested <= 0
        ):
            raise InvalidInput("timeout_ms must be a number above 0")
        return min(float(requested), cap) / 1e3


def create_app(config: Config, device_names: list[str], factory: DeviceFactory) -> web.Application:
    server = Server(config, device_names, factory)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[SERVER_KEY] = server
    app.cleanup_ctx.append(server.lifespan)

    async def drain_on_shutdown(app: web.Application) -> None:
        await server.drain()

    app.on_shutdown.append(drain_on_shutdown)
    app.router.add_post("/api/inference", server.inference)
    app.router.add_get("/healthz", server.healthz)
    app.router.add_get("/readyz", server.readyz)
    return app


def _expire(future: asyncio.Future[Result]) -> None:
    if not future.done():
        future.set_exception(DeadlineExceeded("the request's deadline passed"))


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _error(error: BatchserveError, request_id: str) -> web.Response:
    status, code = _STATUS[type(error)]
    body: dict[str, Any] = {"error": code, "message": str(error), "request_id": request_id}
    headers = {"X-Request-Id": request_id}
    if isinstance(error, Overloaded):
        body["retry_after_ms"] = max(1, round(error.retry_after_s * 1e3))
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    response = _json(status, body)
    response.headers.update(headers)
    return response
