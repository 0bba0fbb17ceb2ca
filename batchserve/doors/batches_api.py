"""OpenAI's Batch API: `POST /v1/batches`, `GET /v1/batches/{id}`, `GET /v1/batches`
(`after`, `limit`) and `POST /v1/batches/{id}/cancel`, in OpenAI's shapes.

Creating a batch checks its input file's lines at once (`batch_lines.check_lines`): lines
that do not make a batch give a batch that has failed, with OpenAI's validation errors;
others give one that is validating, and a replica takes it (`batch_runner.py`). Its lines
run on what online traffic leaves idle (docs/http-api.md, "Batches"). A tenant sees and
cancels only its own batches, and makes them only from its own files.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Any

from aiohttp import web

from ..batching.request import new_request_id
from ..config import Config
from ..errors import BatchserveError, Conflict, InvalidInput, NotFound
from .batch_lines import ENDPOINTS, check_lines
from .batch_runner import BatchRunner
from .batch_store import BatchStore, now_s
from .files_api import Paging, TenantOf, list_page, owner_of
from .openapi import Operation, errors, json_answer
from .wire import error_response, json_response, read_json, request_id_of

WINDOW_S = 24 * 3600
"""The one completion window, "24h": a batch not done by then expires."""
MAX_METADATA = 16
PAGE = Paging(most=100, default=20)
"""A listing of batches: OpenAI's bounds."""
BODY_LIKE = (
    '{"input_file_id": "file-...", "endpoint": "/v1/chat/completions", "completion_window": "24h"}'
)


class BatchesApi:
    def __init__(
        self,
        store: BatchStore,
        runner: BatchRunner,
        tenant_of: TenantOf,
        config: Config,
        served: Callable[[], Collection[str]],
    ) -> None:
        self._store = store
        self._served = served
        """The models served now, by name: a line naming another is a validation error."""
        self._runner = runner
        self._tenant_of = tenant_of
        self._body_limit = config.max_body_bytes

    def mount(self, add: Callable[[str, str, Any, Operation], None]) -> None:
        add("POST", "/v1/batches", self.create, CREATE)
        add("GET", "/v1/batches", self.list, LIST)
        add("GET", "/v1/batches/{batch_id}", self.retrieve, RETRIEVE)
        add("POST", "/v1/batches/{batch_id}/cancel", self.cancel, CANCEL)

    async def create(self, request: web.Request) -> web.Response:
        request_id = request_id_of(request)[0]
        try:
            tenant = self._tenant_of(request)
            owner = owner_of(tenant)
            fields = await read_json(request, self._body_limit, BODY_LIKE)
            file_id, endpoint, metadata = _create_fields(fields)
            file = await self._store.file(owner, file_id)
            if file is None or file["purpose"] != "batch":
                raise NotFound(f"No such File object: {file_id[:64]} (an input file of yours)")
            content = await self._store.content(owner, file_id)
            if content is None:
                raise NotFound(f"No such File object: {file_id[:64]}")
            # Off the loop: 50,000 lines take tens of ms to parse, which online requests
            # would otherwise wait out.
            served = frozenset(self._served())  # read on the loop, checked off it
            checked = await asyncio.to_thread(check_lines, content, endpoint, served)
            batch = _new_batch(file_id, endpoint, metadata, len(checked.lines))
            if checked.errors:
                batch |= {"status": "failed", "failed_at": batch["created_at"],
                          "errors": {"object": "list", "data": checked.errors}}  # fmt: skip
            lines = [] if checked.errors else checked.lines
            await self._store.add_batch(owner, None if tenant is None else tenant.tier,
                                        batch, lines)  # fmt: skip
        except BatchserveError as error:
            return error_response(error, request_id, openai_shape=True)
        self._runner.poke()
        return json_response(200, batch, {"X-Request-Id": request_id})

    async def retrieve(self, request: web.Request) -> web.Response:
        request_id = request_id_of(request)[0]
        batch_id = request.match_info["batch_id"]
        try:
            batch = await self._store.batch(owner_of(self._tenant_of(request)), batch_id)
            if batch is None:
                raise NotFound(f"No such Batch object: {batch_id[:64]}")
        except BatchserveError as error:
            return error_response(error, request_id, openai_shape=True)
        return json_response(200, batch, {"X-Request-Id": request_id})

    async def list(self, request: web.Request) -> web.Response:
        request_id = request_id_of(request)[0]
        try:
            owner = owner_of(self._tenant_of(request))
            after, limit = PAGE.read(request)
            batches = await self._store.batches(owner, after, limit + 1)
        except BatchserveError as error:
            return error_response(error, request_id, openai_shape=True)
        return json_response(200, list_page(batches, limit), {"X-Request-Id": request_id})

    async def cancel(self, request: web.Request) -> web.Response:
        """validating or in progress: cancelling, until the lines running end; cancelling
        or cancelled: as it is; ended otherwise: 409."""
        request_id = request_id_of(request)[0]
        batch_id = request.match_info["batch_id"]
        try:
            owner = owner_of(self._tenant_of(request))
            if await self._store.batch(owner, batch_id) is None:
                raise NotFound(f"No such Batch object: {batch_id[:64]}")
            batch = await self._store.update(batch_id, _cancelling)
            assert batch is not None  # batches are never deleted
            if batch["status"] not in ("cancelling", "cancelled"):
                raise Conflict(f"Cannot cancel a batch with status {batch['status']}.")
            self._runner.status_changed(batch_id)
        except BatchserveError as error:
            return error_response(error, request_id, openai_shape=True)
        return json_response(200, batch, {"X-Request-Id": request_id})


def _cancelling(batch: dict[str, Any]) -> dict[str, Any] | None:
    if batch["status"] not in ("validating", "in_progress"):
        return None
    return batch | {"status": "cancelling", "cancelling_at": now_s()}


def _create_fields(fields: dict[str, Any]) -> tuple[str, str, dict[str, str] | None]:
    unknown = fields.keys() - {"input_file_id", "endpoint", "completion_window", "metadata"}
    if unknown:
        raise InvalidInput(f"Unrecognized request argument supplied: {sorted(unknown)[0][:64]}")
    file_id = fields.get("input_file_id")
    if not isinstance(file_id, str):
        raise InvalidInput("Missing required parameter: 'input_file_id'.")
    endpoint = fields.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise InvalidInput(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.")
    if fields.get("completion_window") != "24h":
        raise InvalidInput("'completion_window' must be '24h'.")
    metadata = fields.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA
        and all(isinstance(k, str) and len(k) <= 64 for k in metadata)
        and all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())
    ):
        raise InvalidInput(
            "'metadata' must be at most 16 pairs of strings (keys up to 64 characters,"
            " values up to 512)"
        )
    return file_id, endpoint, metadata


def _new_batch(
    file_id: str, endpoint: str, metadata: dict[str, str] | None, total: int
) -> dict[str, Any]:
    created = now_s()
    return {
        "id": f"batch_{new_request_id()}",
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": file_id,
        "completion_window": "24h",
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": created,
        "in_progress_at": None,
        "expires_at": created + WINDOW_S,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": total, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


BATCH = {
    "title": "Batch",
    "type": "object",
    "required": ["id", "object", "endpoint", "input_file_id", "status", "request_counts"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "batch"},
        "status": {"enum": ["validating", "in_progress", "finalizing", "completed",
                            "cancelling", "cancelled", "failed", "expired"]},
        "endpoint": {"enum": list(ENDPOINTS)},
        "output_file_id": {"type": ["string", "null"]},
        "error_file_id": {"type": ["string", "null"]},
    },
}  # fmt: skip
_BATCH_ID = {"batch_id": {"type": "string"}}
CREATE = Operation(
    summary="Create a batch from an uploaded file; it runs on idle capacity",
    tag="batches",
    body={
        "title": "BatchRequest",
        "type": "object",
        "required": ["input_file_id", "endpoint", "completion_window"],
        "additionalProperties": False,
        "properties": {
            "input_file_id": {"type": "string"},
            "endpoint": {"enum": list(ENDPOINTS)},
            "completion_window": {"const": "24h"},
            "metadata": {
                "type": ["object", "null"],
                "maxProperties": MAX_METADATA,
                "additionalProperties": {"type": "string"},
            },
        },
    },
    answers={200: json_answer("the batch", BATCH), **errors(400, 401, 404, 413, 503, openai=True)},
    auth="key",
)
LIST = Operation(
    summary="The caller's batches, newest first",
    tag="batches",
    parameters=PAGE.parameters,
    answers={
        200: json_answer("a page of batches", {"type": "object", "required": ["data"]}),
        **errors(400, 401, 503, openai=True),
    },
    auth="key",
)
RETRIEVE = Operation(
    summary="One of the caller's batches: status, counts, files",
    tag="batches",
    path=_BATCH_ID,
    answers={200: json_answer("the batch", BATCH), **errors(401, 404, 503, openai=True)},
    auth="key",
)
CANCEL = Operation(
    summary="Cancel a batch: lines running end, the rest never run",
    tag="batches",
    path=_BATCH_ID,
    answers={200: json_answer("the batch", BATCH), **errors(401, 404, 409, 503, openai=True)},
    auth="key",
)
