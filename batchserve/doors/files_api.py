"""OpenAI's Files API, for the Batch API's input and output files: `POST /v1/files`
(multipart: `purpose` "batch" and `file`, JSON Lines), `GET /v1/files`, `GET /v1/files/{id}`,
`GET /v1/files/{id}/content` and `DELETE /v1/files/{id}`.

A tenant sees, downloads and deletes only its own files (another's look unknown: 404); on a
server without keys there is one namespace. An upload is at most `--batch-file-bytes` and
`--batch-file-lines` lines (413 past either), and each line must be a JSON object (else 400,
naming the line). Deleting an input file does not touch a batch made from it: the batch
copied its lines when it was created. Errors carry OpenAI's body shape.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import BodyPartReader, MultipartReader, web

from ..batching.request import new_request_id
from ..config import Config
from ..errors import BatchserveError, InputTooLarge, InvalidInput, NotFound
from ..rules.tenants import Tenant
from .batch_runner import file_object
from .batch_store import BatchStore
from .openapi import Operation, Schema, errors, json_answer
from .wire import error_response, json_response, request_id_of

TenantOf = Callable[[web.BaseRequest], Tenant | None]
"""Who is asking (`wire.caller_tenant`): raises Unauthenticated for a bad key."""
MAX_FILENAME = 256


def owner_of(tenant: Tenant | None) -> str:
    """The namespace a tenant's files and batches live in: "" without keys."""
    return "" if tenant is None else tenant.id_scope


def list_page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's cursor page of `items` (read one past `limit`, to know if more follow)."""
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }


@dataclass(frozen=True)
class Paging:
    """A listing's `after` (an id) and `limit` query parameters: how they are read and how
    OpenAPI describes them, from one definition for the files and the batches."""

    most: int
    default: int

    def read(self, request: web.BaseRequest) -> tuple[str | None, int]:
        """`after` and `limit` of the request's query; 400 for a limit out of range."""
        after = request.query.get("after")
        try:
            limit = int(request.query.get("limit", self.default))
        except ValueError:
            limit = 0
        if not 1 <= limit <= self.most:
            raise InvalidInput(f"limit must be a whole number from 1 to {self.most}")
        return after, limit

    @property
    def parameters(self) -> tuple[Schema, Schema]:
        return (
            {"name": "after", "in": "query", "schema": {"type": "string"}},
            {
                "name": "limit",
                "in": "query",
                "schema": {"type": "integer", "minimum": 1, "maximum": self.most},
            },
        )


PAGE = Paging(most=10_000, default=10_000)
"""A listing of files: at most 10,000 (OpenAI's `limit` for files), all by default."""


class FilesApi:
    def __init__(self, store: BatchStore, tenant_of: TenantOf, config: Config) -> None:
        self._store = store
        self._tenant_of = tenant_of
        self._max_bytes = min(config.batch_file_bytes, config.max_body_bytes)
        self._bytes_flag = (
            "--batch-file-bytes"
            if config.batch_file_bytes <= config.max_body_bytes
            else "--max-input-bytes: the body limit is 6x it plus 4096"
        )
        """The flag whose limit an upload meets first: the one to name in a refusal."""
        self._max_lines = config.batch_file_lines

    def mount(self, add: Callable[[str, str, Any, Operation], None]) -> None:
        add("POST", "/v1/files", self.upload, UPLOAD)
        add("GET", "/v1/files", self.list, LIST)
        add("GET", "/v1/files/{file_id}", self.retrieve, RETRIEVE)
        add("GET", "/v1/files/{file_id}/content", self.content, CONTENT)
        add("DELETE", "/v1/files/{file_id}", self.delete, DELETE)

    async def upload(self, request: web.Request) -> web.Response:
        request_id = request_id_of(request)[0]
        try:
            owner = owner_of(self._tenant_of(request))
            purpose, filename, content = await self._read_upload(request)
            file = file_object(f"file-{new_request_id()[:24]}", filename, purpose, len(content))
            await self._store.add_file(owner, file, content)
        except BatchserveError as error:
            return error_response(error, request_id, openai_shape=True)
        return json_response(200, file, {"X-Request-Id": request_id})

    async def list(self, request: web.Request) -> web.Response:
        request_id = request_id_of(request)[0]
        try:
            owner = owner_of(self._tenant_of(request))
            after, limit = PAGE.read(request)
            files = await _files(self._store, owner, after, limit + 1, request.query.get("purpose"))
        except BatchserveError as error:
            return error_response(error, request_id, openai_shape=True)
        return json_response(200, list_page(files, limit))

    async def retrieve(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._store.file, lambda f: json_response(200, f))

    async def content(self, request: web.Request) -> web.Response:
        def send(content: bytes) -> web.Response:
            return web.Response(body=content, content_type="application/jsonl")

        return await self._answer(request, self._store.content, send)

    async def delete(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]

        async def delete(owner: str, file_id: str) -> bool | None:
            return await self._store.delete_file(owner, file_id) or None

        answer = {"id": file_id, "object": "file", "deleted": True}
        return await self._answer(request, delete, lambda _: json_response(200, answer))

    async def _answer(
        self,
        request: web.Request,
        find: Callable[[str, str], Any],
        send: Callable[[Any], web.Response],
    ) -> web.Response:
        """`send(found)` for the caller's file of the path's id; 404 for none."""
        request_id = request_id_of(request)[0]
        file_id = request.match_info["file_id"]
        try:
            found = await find(owner_of(self._tenant_of(request)), file_id)
            if found is None:
                raise NotFound(f"No such File object: {file_id[:64]}")
        except BatchserveError as error:
            return error_response(error, request_id, openai_shape=True)
        response = send(found)
        response.headers["X-Request-Id"] = request_id
        return response

    async def _read_upload(self, request: web.Request) -> tuple[str, str, bytes]:
        """The form's purpose, the file's name and its content, checked."""
        if not request.content_type.startswith("multipart/"):
            raise InvalidInput('upload the file as multipart/form-data with "purpose" and "file"')
        try:
            purpose, filename, content = await self._parts(await request.multipart())
        except ValueError as exc:  # no boundary, a part's headers broken
            raise InvalidInput(f"the multipart body does not parse: {str(exc)[:80]}") from None
        if purpose != "batch":
            raise InvalidInput('"purpose" must be "batch": this server takes files for batches')
        if content is None or filename is None:
            raise InvalidInput('the form needs a "file" part')
        await asyncio.to_thread(self._check_lines, content)  # off the loop, as a batch's are
        return purpose, filename, content

    async def _parts(self, reader: MultipartReader) -> tuple[str | None, str | None, bytes | None]:
        purpose = filename = content = None
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise InvalidInput("a nested multipart body is not a file")
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode(errors="replace")[:64]
            elif part.name == "file":
                filename = (part.filename or "upload.jsonl")[:MAX_FILENAME]
                content = await self._read_file(part)
            else:
                await part.release()
        return purpose, filename, content

    async def _read_file(self, part: BodyPartReader) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while chunk := await part.read_chunk():
            size += len(chunk)
            if size > self._max_bytes:
                raise InputTooLarge(f"the file is over the limit of {self._max_bytes} bytes"
                                    f" ({self._bytes_flag})")  # fmt: skip
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_lines(self, content: bytes) -> None:
        """JSON Lines: each line one JSON object, at most `--batch-file-lines` of them."""
        count = 0
        for number, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            count += 1
            if count > self._max_lines:
                raise InputTooLarge(f"the file holds more than {self._max_lines} lines"
                                    " (--batch-file-lines)")  # fmt: skip
            try:
                value = orjson.loads(line)
            except orjson.JSONDecodeError:
                value = None
            if not isinstance(value, dict):
                raise InvalidInput(
                    f"the file is not JSON Lines: line {number} is not a JSON object"
                )
        if not count:
            raise InvalidInput("the file is empty: a batch needs one request a line")


async def _files(
    store: BatchStore, owner: str, after: str | None, count: int, purpose: str | None
) -> list[dict[str, Any]]:
    """`count` of the owner's files after `after`, of `purpose` if given: filtered as the
    store's pages are read, so a page is never cut short by the filter."""
    found: list[dict[str, Any]] = []
    size = count if purpose is None else max(count, FILTERED_PAGE)
    while len(found) < count:
        page = await store.files(owner, after, size)
        found += [file for file in page if purpose in (None, file["purpose"])]
        if len(page) < size:
            break
        after = page[-1]["id"]
    return found[:count]


FILTERED_PAGE = 500
"""Files read from the store at a time while a filter leaves some out: few round trips."""


FILE = {
    "title": "OpenAIFile",
    "type": "object",
    "required": ["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "file"},
        "bytes": {"type": "integer"},
        "created_at": {"type": "integer"},
        "filename": {"type": "string"},
        "purpose": {"enum": ["batch", "batch_output"]},
        "status": {"const": "processed"},
    },
}
_FILE_ID = {"file_id": {"type": "string"}}
UPLOAD = Operation(
    summary="Upload a JSON Lines file for a batch (multipart: purpose, file)",
    tag="batches",
    answers={200: json_answer("the file", FILE), **errors(400, 401, 413, 503, openai=True)},
    auth="key",
)
LIST = Operation(
    summary="The caller's files, newest first",
    tag="batches",
    parameters=(*PAGE.parameters, {"name": "purpose", "in": "query", "schema": {"type": "string"}}),
    answers={
        200: json_answer("a page of files", {"type": "object", "required": ["data"]}),
        **errors(400, 401, 503, openai=True),
    },
    auth="key",
)
RETRIEVE = Operation(
    summary="One of the caller's files",
    tag="batches",
    path=_FILE_ID,
    answers={200: json_answer("the file", FILE), **errors(401, 404, 503, openai=True)},
    auth="key",
)
CONTENT = Operation(
    summary="A file's content: the input, or a batch's output or errors (JSON Lines)",
    tag="batches",
    path=_FILE_ID,
    answers={
        200: json_answer("its lines", {"type": "string"}),
        **errors(401, 404, 503, openai=True),
    },
    auth="key",
)
DELETE = Operation(
    summary="Delete one of the caller's files",
    tag="batches",
    path=_FILE_ID,
    answers={
        200: json_answer("deleted", {"type": "object", "required": ["id", "deleted"]}),
        **errors(401, 404, 503, openai=True),
    },
    auth="key",
)
