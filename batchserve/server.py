"""The HTTP contract: admits requests, holds the pending futures, answers each one once.

`Server` owns the pending-futures dict (request id -> future), the lifecycle phase and, via
`lifespan`, the pool and the batcher, which it starts in order and stops in reverse. The
status API (`status_api.py`) and the dashboard (`dashboard.py`) are mounted beside it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import orjson
from aiohttp import web

from .backends import DeviceFactory
from .batcher import Batcher
from .config import Config
from .dashboard import Dashboard
from .errors import (
    BatchserveError,
    DeadlineExceeded,
    DuplicateRequestId,
    InvalidInput,
    NotReady,
    RateLimited,
    Unauthenticated,
)
from .fair_queue import TIER_RANKS
from .faults import BatchBudget, RetryBudget
from .gpu_pool import GpuPool
from .http_io import (
    STATUS,
    answer_body,
    error_response,
    json_response,
    read_input,
    request_id_of,
)
from .item import QueuedRequest, Result
from .metrics import NO_TIER, Metrics
from .policy import make_policy
from .status_api import StatusApi
from .tenants import KeyRing, Tenant

log = logging.getLogger(__name__)
access_log = logging.getLogger("batchserve.access")

SERVER_KEY: web.AppKey[Server] = web.AppKey("batchserve_server")


class Admitted(NamedTuple):
    text: str
    timeout_s: float
    tenant: Tenant | None


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
            shed=config.keys_file is not None,
            retry_budget=RetryBudget(
                ratio=config.retry_budget,
                reserve=config.retry_reserve,
                tokens=config.retry_reserve,
            ),
        )
        self.pool.listener = self.batcher
        self.metrics = (
            Metrics(self.batcher, self.pool, slo_s=config.slo_ms / 1e3) if config.metrics else None
        )
        self.keys = (
            KeyRing.load(config.keys_file, config.anonymous_tier) if config.keys_file else None
        )
        self._drained: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"<Server {self.phase.value} pending={len(self.pending)}>"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "requests arrive only after lifespan started"
        return self._loop

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
        return json_response(200, {"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready while not draining and at least one device is healthy; lists each device."""
        status = self.phase.value
        if self.phase is Phase.READY and not self.pool.healthy:
            status = "no healthy device"
        body = {"status": status, "devices": self.pool.states()}
        return json_response(200 if status == Phase.READY.value else 503, body)

    async def inference(self, request: web.Request) -> web.Response:
        loop = self._loop
        assert loop is not None, "requests arrive only after lifespan started"
        arrival = loop.time()
        request_id, problem = request_id_of(request)
        tenant = None
        try:
            admitted = await self.admit(request, problem)
            tenant = admitted.tenant
            if request_id in self.pending:
                raise DuplicateRequestId(f"request id {request_id} is already in flight")
            result = await self._run(loop, request_id, arrival, admitted)
        except BatchserveError as error:
            self.record("inference", request_id, arrival, error, tenant)
            return error_response(error, request_id)
        now = loop.time()
        self.record("inference", request_id, arrival, result, tenant, now)
        timing = f"queue;dur={result.queue_s * 1e3:.3f}, compute;dur={result.compute_s * 1e3:.3f}"
        return json_response(
            200,
            answer_body(request_id, result, now - arrival),
            {"Server-Timing": timing, "X-Request-Id": request_id},
        )

    async def admit(self, request: web.Request, problem: InvalidInput | None) -> Admitted:
        """Checks who calls, their rate, and that the server can take the request."""
        if problem is not None:
            raise problem
        tenant = self.authenticate(request)
        if tenant is not None:
            assert self.keys is not None
            wait_s, bucket = self.keys.take(tenant, self.loop.time())
            if wait_s:
                raise RateLimited(
                    f"tenant {tenant.name} is over the {tenant.tier} tier's rate of"
                    f" {bucket.rate:g} requests a second",
                    retry_after_s=wait_s,
                    limit=bucket.burst,
                    reset_s=bucket.seconds_to_full(),
                )
        if self.phase is not Phase.READY:
            raise NotReady(f"the server is {self.phase.value}")
        if not self.pool.healthy:
            raise NotReady("no device is healthy; see /readyz")
        text, timeout_s = await read_input(request, self.config)
        if tenant is not None:
            assert self.keys is not None
            tier_timeout_ms = self.keys.limits[tenant.tier].timeout_ms
            if tier_timeout_ms is not None:
                timeout_s = min(timeout_s, tier_timeout_ms / 1e3)
        return Admitted(text, timeout_s, tenant)

    def authenticate(self, request: web.Request) -> Tenant | None:
        """The caller's tenant; None when the server runs open (no --keys-file)."""
        if self.keys is None:
            return None
        tenant = self.keys.authenticate(request.headers.get("Authorization"))
        if tenant is None:
            raise Unauthenticated(
                "send Authorization: Bearer <API key>; this one is missing or unknown"
            )
        return tenant

    def record(
        self,
        route: str,
        request_id: str,
        arrival: float,
        outcome: Result | BatchserveError,
        tenant: Tenant | None,
        now: float | None = None,
    ) -> None:
        """Counts an answer in the metrics and, when asked for, writes its access-log line."""
        if now is None:
            now = self.loop.time()
        tier = NO_TIER if tenant is None else tenant.tier
        if isinstance(outcome, Result):
            status, code = 200, None
            if self.metrics is not None:
                self.metrics.ok(route, tier, now, now - arrival, outcome)
        else:
            status, code = STATUS[type(outcome)]
            if self.metrics is not None:
                self.metrics.failed(route, tier, status, code)
        if self.config.access_log:
            line = _access_line(route, request_id, tenant, status, code, now - arrival, outcome)
            access_log.info(line)

    def submit(
        self, loop: asyncio.AbstractEventLoop, request_id: str, arrival: float, admitted: Admitted
    ) -> tuple[QueuedRequest, asyncio.TimerHandle]:
        """Queues a request under the pending dict and arms its deadline; the caller must
        call `release` once its future is done."""
        deadline = arrival + admitted.timeout_s
        future: asyncio.Future[Result] = loop.create_future()
        queued = QueuedRequest(request_id, admitted.text, arrival, deadline, future)
        if (tenant := admitted.tenant) is not None:
            queued.tenant, queued.tier_rank = tenant.name, TIER_RANKS[tenant.tier]
            queued.tenant_weight = tenant.weight
        self.batcher.submit(queued)
        self.pending[request_id] = future
        # One timer that fails the future, rather than asyncio.timeout_at: the hot path then
        # needs no Timeout object, no task-cancel round trip and no extra loop lookups.
        return queued, loop.call_at(deadline, _expire, future)

    def release(self, request_id: str, expiry: asyncio.TimerHandle) -> None:
        expiry.cancel()
        del self.pending[request_id]
        self.batcher.discard(request_id)

    async def _run(
        self, loop: asyncio.AbstractEventLoop, request_id: str, arrival: float, admitted: Admitted
    ) -> Result:
        queued, expiry = self.submit(loop, request_id, arrival, admitted)
        try:
            return await queued.future
        finally:
            self.release(request_id, expiry)


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
    status_api = StatusApi(server)
    app.router.add_post("/api/requests", status_api.submit)
    app.router.add_get("/api/requests/{request_id}", status_api.poll)
    if server.metrics is not None:
        dashboard = Dashboard(server, server.metrics)
        app.router.add_get("/", dashboard.page)
        app.router.add_get("/api/stats", dashboard.stats)
        app.router.add_get("/metrics", dashboard.scrape)
        app.router.add_static("/static/", dashboard.static_dir)
    return app


def _expire(future: asyncio.Future[Result]) -> None:
    if not future.done():
        future.set_exception(DeadlineExceeded("the request's deadline passed"))


def _access_line(
    route: str,
    request_id: str,
    tenant: Tenant | None,
    status: int,
    code: str | None,
    latency_s: float,
    outcome: Result | BatchserveError,
) -> str:
    """One JSON object: who, what status, where the time went. Never the input text."""
    line: dict[str, Any] = {
        "ts": round(time.time(), 3),
        "route": route,
        "request_id": request_id,
        "tenant": None if tenant is None else tenant.name,
        "status": status,
        "error": code,
        "latency_ms": round(latency_s * 1e3, 3),
    }
    if isinstance(outcome, Result):
        line |= {
            "queue_ms": round(outcome.queue_s * 1e3, 3),
            "compute_ms": round(outcome.compute_s * 1e3, 3),
            "batch_id": outcome.batch_id,
            "batch_size": outcome.batch_size,
            "device": outcome.device,
        }
    return orjson.dumps(line).decode()
