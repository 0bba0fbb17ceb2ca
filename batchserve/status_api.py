"""Submit, then poll, for clients that cannot hold a connection open for the answer.

`POST /api/requests` takes the same body as /api/inference, queues it and answers 202 at
once; `GET /api/requests/{id}` says queued, running, completed (with the answer) or failed
(with the error), until the result expires. The request runs exactly like a synchronous one:
same queue, deadline, batching and fault handling.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING
from urllib.parse import quote

from aiohttp import web

from .errors import BackendError, BatchserveError, DuplicateRequestId, NotFound, Overloaded
from .http_io import (
    MAX_REQUEST_ID,
    answer_body,
    error_body,
    error_response,
    json_response,
    request_id_of,
)
from .item import Result
from .results import ResultStore

if TYPE_CHECKING:
    from .server import Server
    from .tenants import Tenant


class StatusApi:
    def __init__(self, server: Server) -> None:
        self._server = server
        self.store = ResultStore(
            capacity=server.config.result_store_size, ttl_s=server.config.result_ttl_s
        )

    async def submit(self, request: web.Request) -> web.Response:
        server = self._server
        loop = server.loop
        arrival = loop.time()
        request_id, problem = request_id_of(request)
        tenant = None
        try:
            admitted = await server.admit(request, problem)
            tenant = admitted.tenant
            if request_id in server.pending or request_id in self.store:
                raise DuplicateRequestId(
                    f"request id {request_id} is in use until its result expires"
                )
            if not self.store.make_room(arrival):
                raise Overloaded("the status store is full of unfinished requests", 1.0)
            queued, expiry = server.submit(loop, request_id, arrival, admitted)
        except BatchserveError as error:
            server.record("requests", request_id, arrival, error, tenant)
            return error_response(error, request_id)
        self.store.add(queued, tenant)
        queued.future.add_done_callback(
            functools.partial(self._finished, request_id, tenant, arrival, expiry)
        )
        return json_response(
            202,
            {"request_id": request_id, "status": "queued"},
            {"Location": f"/api/requests/{quote(request_id, safe='')}", "X-Request-Id": request_id},
        )

    async def poll(self, request: web.Request) -> web.Response:
        """A tenant sees only its own requests; another's look the same as unknown ones."""
        request_id = request.match_info["request_id"]
        if len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
            return error_response(NotFound("no such request"), request_id_of(request)[0])
        try:
            tenant = self._server.authenticate(request)
        except BatchserveError as refused:
            return error_response(refused, request_id)
        answer = self.store.get(request_id, self._server.loop.time(), tenant)
        if answer is None:
            missing = NotFound(f"no request {request_id}: never submitted, or its result expired")
            return error_response(missing, request_id)
        return json_response(200, answer)

    def _finished(
        self,
        request_id: str,
        tenant: Tenant | None,
        arrival: float,
        expiry: asyncio.TimerHandle,
        future: asyncio.Future[Result],
    ) -> None:
        server = self._server
        server.release(request_id, expiry)
        now = server.loop.time()
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or (error is not None and not isinstance(error, BatchserveError)):
            error = BackendError(f"the request ended unexpectedly: {error!r}")
        if isinstance(error, BatchserveError):
            server.record("requests", request_id, arrival, error, tenant, now)
            answer = {
                "request_id": request_id,
                "status": "failed",
                "error": error_body(error, request_id),
            }
        else:
            result = future.result()
            server.record("requests", request_id, arrival, result, tenant, now)
            answer = {"status": "completed", **answer_body(request_id, result, now - arrival)}
        self.store.finish(request_id, answer, now)
