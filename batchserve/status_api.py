"""Submit, then poll, for clients that cannot hold a connection open for the answer.

`POST /api/requests` takes the same body as /api/inference, hands it to `engine.submit` and
answers 202 at once; `GET /api/requests/{id}` says queued, running, completed (with the
answer) or failed (with the error), until the result expires. The request runs exactly like
a synchronous one: the engine's queue, deadline, batching and fault handling.
"""

from __future__ import annotations

from urllib.parse import quote

from aiohttp import web

from .engine import Engine
from .errors import BatchserveError, DuplicateRequestId, NotFound, Overloaded
from .http_io import (
    MAX_REQUEST_ID,
    answer_body,
    error_body,
    error_response,
    json_response,
    read_call,
    read_input,
    request_id_of,
)
from .item import Result, Ticket
from .results import ResultStore


class StatusApi:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.store = ResultStore(
            capacity=engine.config.result_store_size, ttl_s=engine.config.result_ttl_s
        )

    async def submit(self, request: web.Request) -> web.Response:
        engine = self._engine
        arrival = engine.clock.time()
        call = await read_call(request, engine, "requests", arrival, read_input)
        if isinstance(call, web.Response):
            return call
        request_id = call.request_id
        try:
            if request_id in self.store:
                raise DuplicateRequestId(
                    f"request id {request_id} is in use until its result expires"
                )
            if not self.store.make_room(arrival):
                raise Overloaded("the status store is full of unfinished requests", 1.0)
        except BatchserveError as error:
            engine.record("requests", request_id, arrival, error, call.tenant)
            return error_response(error, request_id)
        try:
            ticket = engine.submit(
                call.body.text,
                model=call.body.model,
                version=call.body.version,
                params=call.body.params,
                timeout_ms=call.body.timeout_ms,
                request_id=request_id,
                tenant=call.tenant,
                arrival=arrival,
            )
        except BatchserveError as error:
            return error_response(error, request_id)
        self.store.add(ticket, call.tenant)
        ticket.add_done_callback(self._finished)
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
            tenant = self._engine.authenticate(request.headers.get("Authorization"))
        except BatchserveError as refused:
            return error_response(refused, request_id)
        answer = self.store.get(request_id, self._engine.clock.time(), tenant)
        if answer is None:
            missing = NotFound(f"no request {request_id}: never submitted, or its result expired")
            return error_response(missing, request_id)
        return json_response(200, answer)

    def _finished(self, ticket: Ticket) -> None:
        now = self._engine.clock.time()
        outcome = ticket.outcome()
        request_id = ticket.request_id
        if isinstance(outcome, Result):
            answer = {
                "status": "completed",
                **answer_body(request_id, outcome, now - ticket.arrival),
            }
        else:
            answer = {
                "request_id": request_id,
                "status": "failed",
                "error": {**error_body(outcome, request_id), "status": outcome.status},
            }
        self.store.finish(request_id, answer, now)
