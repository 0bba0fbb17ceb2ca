"""Submit, then poll, for clients that cannot hold a connection open for the answer.

`POST /api/requests` takes the same body as /api/inference, hands it to the engine's `submit` and
answers 202 at once; `GET /api/requests/{id}` says queued, running, completed (with the
answer) or failed (with the error), until the result expires; with `?wait_ms=N` it first
waits up to N ms for an unfinished request to end (a long poll: one request instead of a
poll every few ms). The request runs exactly like a synchronous one: the engine's queue,
deadline, batching and fault handling.

With `--result-store` redis or sqlite, each record is also written there (`shared_records.py`)
so that a poll reaching another replica, or this one after a restart, finds it; requests a
stopped replica left queued in an SQLite store run again when it starts. While that store
fails, a submit or a poll it is needed for is answered 503 STORE_UNAVAILABLE with Retry-After,
and /readyz turns 503 (`store_problem`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

from aiohttp import web

from ..batching.request import Ask, Result, Ticket
from ..clock import sleep_until
from ..engine.requests import Caller
from ..errors import (
    BatchserveError,
    DuplicateRequestId,
    InvalidInput,
    NotFound,
    Overloaded,
    StoreUnavailable,
)
from ..rules.tenants import Tenant
from ..tasks import TaskSet
from .face import BatchFace
from .openapi import ERROR, REQUEST_ID, TIMEOUT, Operation, errors, json_answer
from .shared_records import Record, SharedRecords, open_records
from .status_store import ResultStore
from .wire import (
    INFERENCE_ANSWER,
    INFERENCE_BODY,
    INPUT_LIKE,
    MAX_REQUEST_ID,
    answer_body,
    caller_tenant,
    error_body,
    error_response,
    json_response,
    parse_input,
    read_call,
    request_id_of,
)

log = logging.getLogger(__name__)

MAX_WAIT_MS = 60_000.0
"""The longest a poll may wait for its request to end (`?wait_ms=`)."""
SHARED_POLL_S = 0.05
"""How often a waiting poll reads the shared store for a request another replica runs."""
UNFINISHED = frozenset({"queued", "running"})


class StatusApi:
    def __init__(self, engine: BatchFace) -> None:
        self._engine = engine
        config = engine.config
        self.store = ResultStore(
            capacity=config.result_store_size,
            ttl_s=config.result_ttl_s,
            max_bytes=config.result_store_bytes,
        )
        self._shared: SharedRecords | None = open_records(
            config.result_store, config.timeout_ms / 1e3 + config.result_ttl_s, engine.clock
        )
        self._writes = TaskSet(self._write_failed)
        """Records written to the shared store; awaited, not cancelled, at shutdown."""

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup_ctx, after the engine's: opens the shared store and runs again what
        a stopped replica left queued in it; at the end every record is written."""
        if self._shared is None:
            yield
            return
        await self._shared.start()
        try:
            for request_id, record in await self._shared.unfinished():
                self._run_again(request_id, record)
            yield
        finally:
            await self._writes.join()
            await self._shared.close()

    async def submit(self, request: web.Request) -> web.Response:
        engine = self._engine
        call = await read_call(request, engine, "requests", parse_input, like=INPUT_LIKE)
        if isinstance(call, web.Response):
            return call
        request_id, arrival = call.request_id, call.arrival
        try:
            if self.store.holds(request_id, call.tenant):
                raise DuplicateRequestId(
                    f"request id {request_id} is in use until its result expires"
                )
            size = len(call.body.text.encode(errors="surrogatepass"))
            if not self.store.make_room(arrival, size):
                raise Overloaded(
                    "the status store is full of unfinished requests"
                    " (--result-store-size, --result-store-bytes)",
                    1.0,
                )
            if self._shared is not None:
                queued = {"request_id": request_id, "status": "queued",
                          "submitted": call.body._asdict()}  # fmt: skip
                shared_id = _shared_id(request_id, call.tenant)
                if not await self._shared.add(shared_id, Record(_owner(call.tenant), queued)):
                    raise DuplicateRequestId(
                        f"request id {request_id} is in use until its result expires"
                    )
        except BatchserveError as error:
            engine.record("requests", request_id, arrival, error, call.tenant)
            return error_response(error, request_id)
        try:
            ticket = engine.submit(call.body, call.caller)
        except BatchserveError as error:
            if self._shared is not None:  # refused: its id is free again, as in memory
                with contextlib.suppress(StoreUnavailable):  # else it expires unfinished
                    await self._shared.remove(_shared_id(request_id, call.tenant))
            return error_response(error, request_id)
        self.store.add(ticket, call.tenant, size)
        ticket.add_done_callback(functools.partial(self._finished, call.tenant))
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
            tenant = caller_tenant(request, self._engine)  # the tenant it was submitted as
            wait_s = _wait_s(request.query.get("wait_ms"))
        except BatchserveError as refused:
            return error_response(refused, request_id)
        try:
            answer = await self._state(request_id, tenant)
            if answer is not None and answer["status"] in UNFINISHED and wait_s:
                answer = await self._wait(request_id, tenant, answer, wait_s)
        except StoreUnavailable as error:
            return error_response(error, request_id)
        if answer is None:
            missing = NotFound(f"no request {request_id}: never submitted, or its result expired")
            return error_response(missing, request_id)
        return json_response(200, answer, {"X-Request-Id": request_id})

    async def store_problem(self) -> str | None:
        """For /readyz: why the shared result store cannot be used now, or None."""
        if self._shared is None:
            return None
        try:
            await self._shared.check()
        except StoreUnavailable as error:
            return str(error)
        return None

    async def _state(self, request_id: str, tenant: Tenant | None) -> dict[str, Any] | None:
        """What a poll says now: from this replica's store, else from the shared one."""
        answer = self.store.get(request_id, self._engine.clock.time(), tenant)
        if answer is None and self._shared is not None:
            record = await self._shared.get(_shared_id(request_id, tenant))
            if record is not None and record.owner == _owner(tenant):
                answer = record.body
        return answer

    async def _wait(
        self, request_id: str, tenant: Tenant | None, answer: dict[str, Any], wait_s: float
    ) -> dict[str, Any] | None:
        """What a poll says once the request ends, or after `wait_s`: a request this replica
        runs is awaited; one that another replica runs (a shared store) is read again every
        SHARED_POLL_S, since no replica hears of another's answers."""
        clock = self._engine.clock
        until = clock.time() + wait_s
        ticket = self.store.unfinished(request_id, tenant)
        if ticket is not None:
            await ticket.wait(clock, until)
            if ticket.done():  # its done callback, which files the answer, may not have run
                return self._answer(ticket)
            return await self._state(request_id, tenant)
        state: dict[str, Any] | None = answer
        while state is not None and state["status"] in UNFINISHED and clock.time() < until:
            await sleep_until(clock, min(until, clock.time() + SHARED_POLL_S))
            state = await self._state(request_id, tenant)
        return state

    def _finished(self, tenant: Tenant | None, ticket: Ticket) -> None:
        answer = self._answer(ticket)
        self.store.finish(ticket.request_id, answer, self._engine.clock.time(), tenant)
        self._write_shared(_shared_id(ticket.request_id, tenant), answer, _owner(tenant))

    def _answer(self, ticket: Ticket) -> dict[str, Any]:
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
        return answer

    def _write_shared(self, shared_id: str, answer: dict[str, Any], owner: str | None) -> None:
        if self._shared is not None:
            ttl_s = self._engine.config.result_ttl_s
            write = self._shared.finish(shared_id, Record(owner, answer), ttl_s)
            self._writes.start(write, name=f"batchserve-record-{shared_id}")

    def _run_again(self, shared_id: str, record: Record) -> None:
        """A request a stopped replica accepted and never answered: submitted again under
        its id; its owner may poll it from the shared record."""
        fields = record.body["submitted"]
        request_id = record.body["request_id"]
        try:
            ticket = self._engine.submit(Ask(**fields), Caller(request_id=request_id))
        except BatchserveError as error:
            log.error("could not run %s again: %s", request_id, error)
            return
        log.info("running %s again: it was queued when this server last stopped", request_id)
        ticket.add_done_callback(
            lambda done: self._write_shared(shared_id, self._answer(done), record.owner)
        )

    def _write_failed(self, task_name: str, error: BaseException) -> None:
        log.error("%s was not written to the result store: %s", task_name, error)


def _wait_s(wait_ms: str | None) -> float:
    """The poll's `wait_ms` in seconds; 0 when it has none."""
    if wait_ms is None:
        return 0.0
    try:
        waited = float(wait_ms)
    except ValueError:
        waited = math.nan
    if not 0 <= waited <= MAX_WAIT_MS:  # NaN fails too
        raise InvalidInput(f"wait_ms must be a number of ms from 0 to {MAX_WAIT_MS:.0f}")
    return waited / 1e3


def _owner(tenant: Tenant | None) -> str | None:
    return None if tenant is None else tenant.id_scope


def _shared_id(request_id: str, tenant: Tenant | None) -> str:
    """A request's key in the shared store: its id within its tenant's namespace. The
    scope's length goes first, so no scope and id can spell another pair's key."""
    if tenant is None:
        return request_id
    scope = tenant.id_scope
    return f"{len(scope)}:{scope}:{request_id}"


SUBMIT = Operation(
    summary="Submit one input; poll its answer at the Location",
    tag="status",
    parameters=(REQUEST_ID, TIMEOUT),
    body=INFERENCE_BODY,
    answers={
        202: json_answer(
            "queued",
            {
                "type": "object",
                "required": ["request_id", "status"],
                "properties": {"request_id": {"type": "string"}, "status": {"const": "queued"}},
            },
            "Location",
        ),
        **errors(400, 401, 404, 409, 413, 429, 503, 504),
    },
    auth="key",
)
POLL = Operation(
    summary="A submitted request's state: queued, running, completed or failed",
    tag="status",
    path={"request_id": {"type": "string", "minLength": 1, "maxLength": MAX_REQUEST_ID}},
    parameters=(
        {
            "name": "wait_ms",
            "in": "query",
            "schema": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_MS},
            "description": f"wait up to this many ms (at most {MAX_WAIT_MS:.0f}) for it to end",
        },
    ),
    answers={
        200: json_answer(
            "its state",
            {
                "title": "RequestState",
                "type": "object",
                "required": ["request_id", "status"],
                "properties": {
                    "request_id": {"type": "string"},
                    "status": {"enum": ["queued", "running", "completed", "failed"]},
                    "error": {**ERROR, "title": "FailedRequest"},
                },
                "oneOf": [
                    {"properties": {"status": {"enum": ["queued", "running", "failed"]}}},
                    {
                        "properties": {"status": {"const": "completed"}},
                        **{k: INFERENCE_ANSWER[k] for k in ("required", "properties")},
                    },
                ],
            },
        ),
        **errors(400, 401, 404, 503),
    },
    auth="key",
)
