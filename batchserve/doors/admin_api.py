"""The admin door: versions loaded, reweighted and removed without a restart.

    PUT    /admin/models/{name}/versions/{version}   body: the models-file fields -> 202
    PATCH  /admin/models/{name}/versions/{version}   body: {"weight": 10}          -> 200
    DELETE /admin/models/{name}/versions/{version}                                  -> 202

Mounted only with `--admin-key`; callers send `Authorization: Bearer <admin key>` (a wrong or
missing key is 401). A bad body is 400 naming the field and changes nothing. The engine
logs every change. The key is compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ..config import BACKEND_BATCH_LIMIT, DTYPES, Config
from ..engine.versions import Versions
from ..errors import BatchserveError, InvalidInput, Unauthenticated
from ..models.specs import MAX_NAME, SpecError, spec_from_fields
from ..rules.tenants import bearer_secret
from .openapi import Operation, errors, json_answer
from .wire import error_response, json_response, read_json, request_id_of

ROUTE = "/admin/models/{name}/versions/{version}"
Change = Callable[[web.Request, str, str], Awaitable[dict[str, Any]]]
"""One admin change: (request, model name, version) to the version's description."""


class AdminApi:
    """`versions` changes them; `device_names` are the server's devices, where a version
    that names none runs; `settings()` the running settings (a reload replaces them)."""

    def __init__(
        self,
        versions: Versions,
        device_names: list[str],
        settings: Callable[[], Config],
        admin_key: str,
    ) -> None:
        self._versions = versions
        self._device_names = device_names
        self._settings = settings
        self._key = admin_key.encode()

    async def put(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._put, 202)

    async def patch(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._patch, 200)

    async def delete(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._delete, 202)

    async def _answer(self, request: web.Request, change: Change, status: int) -> web.Response:
        request_id = request_id_of(request)[0]
        try:
            authorize(request.headers.get("Authorization"), self._key)
            body = await change(request, request.match_info["name"], request.match_info["version"])
        except BatchserveError as error:
            return error_response(error, request_id)
        return json_response(status, body, {"X-Request-Id": request_id})

    async def _put(self, request: web.Request, name: str, version: str) -> dict[str, Any]:
        fields = await read_json(request, self._settings().max_body_bytes, PUT_LIKE)
        for field, value in (("name", name), ("version", version)):
            if fields.setdefault(field, value) != value:
                raise InvalidInput(f"field {field!r} differs from the path's {value!r}")
        # A version that names no devices runs on the server's, not on --devices: a server
        # started from --models never reads that flag, and its default (sim:4) may be none
        # of its devices.
        fields.setdefault("devices", _as_devices(self._device_names))
        config = self._settings()
        try:
            spec = spec_from_fields(fields, config)
        except SpecError as exc:
            raise InvalidInput(str(exc)) from None
        return {"name": name, **self._versions.add(spec, config)}

    async def _patch(self, request: web.Request, name: str, version: str) -> dict[str, Any]:
        fields = await read_json(request, self._settings().max_body_bytes, '{"weight": 2}')
        weight = fields.get("weight")
        if set(fields) != {"weight"}:
            raise InvalidInput("PATCH takes one field, 'weight'")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise InvalidInput("field 'weight' must be a number more than 0")
        return {"name": name, **self._versions.set_weight(name, version, float(weight))}

    async def _delete(self, request: web.Request, name: str, version: str) -> dict[str, Any]:
        return {"name": name, **self._versions.remove(name, version)}


def authorize(authorization: str | None, key: bytes) -> None:
    """Raises Unauthenticated unless `authorization` is `Bearer <key>`."""
    sent = bearer_secret(authorization)
    if sent is None or not hmac.compare_digest(sent, key):
        raise Unauthenticated("send Authorization: Bearer <admin key>")


_VERSION = {
    "title": "VersionChange",
    "type": "object",
    "required": ["name", "version", "state"],
    "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                   "state": {"type": "string"}},
}  # fmt: skip
_PATH = {"name": {"type": "string", "minLength": 1}, "version": {"type": "string", "minLength": 1}}
_PATH_ECHO = {"type": "string", "description": "the path's (it may be left out); another is 400"}
_FN = {"type": "string", "description": "package.module:attr, imported as the version loads"}
PUT_BODY: dict[str, Any] = {
    "title": "VersionSpec",
    "type": "object",
    "additionalProperties": False,
    "description": "a models-file entry's fields (docs/models.md). A generation model"
    " (generator) is added only by --models and a restart. Rules JSON Schema"
    " cannot state are 400: fn and fn_per_device not both; max_batch_tokens needs cost"
    " length; model_path needs fn_per_device (a reranker's folder, say); the path's name"
    f" and version are 1 to {MAX_NAME} letters, digits or -_.",
    "properties": {
        "name": _PATH_ECHO,
        "version": _PATH_ECHO,
        "fn": _FN,
        "fn_per_device": _FN,
        "devices": {"type": "string", "description": "as --devices; absent: the server's own"
                    " devices (every device a version names must be one of them)"},
        "max_batch_size": {"type": "integer", "minimum": 1, "maximum": BACKEND_BATCH_LIMIT},
        "weight": {"type": "number", "exclusiveMinimum": 0},
        "cost": {"enum": ["flat", "length"]},
        "max_batch_tokens": {"type": "integer", "minimum": 1},
        "slo_ms": {"type": "number", "exclusiveMinimum": 0},
        "max_linger_ms": {"type": "number", "minimum": 0},
        "dtype": {"enum": list(DTYPES)},
        "model_path": {"type": "string", "description": "the folder fn_per_device loads"},
        "dimensions": {"type": "array", "items": {"type": "integer", "minimum": 1},
                       "description": "an embedder's Matryoshka sizes"},
    },
}  # fmt: skip
"""The admin PUT's body: the models file's fields (models/specs.py) a batch version takes."""


PUT_LIKE = '{"fn": "package.module:attr", "devices": "sim:2"}'
"""What the admin PUT's body looks like, for one that does not (a models-file entry)."""


def _as_devices(names: list[str]) -> str:
    """The devices field that names exactly `names` (sim:N for simulated ones)."""
    if names and all(name.startswith("sim:") for name in names):
        return f"sim:{len(names)}"  # the pool's simulated devices are sim:0 .. sim:N-1
    return ",".join(names)


ADMIN_PUT = Operation(
    summary="Add a version: it loads in the background",
    tag="admin",
    path=_PATH,
    body=PUT_BODY,
    answers={202: json_answer("loading", _VERSION), **errors(400, 401, 409, 413, 503)},
    auth="admin",
)
ADMIN_PATCH = Operation(
    summary="Set a version's weight",
    tag="admin",
    path=_PATH,
    body={"type": "object", "required": ["weight"], "additionalProperties": False,
          "properties": {"weight": {"type": "number", "exclusiveMinimum": 0}}},
    answers={200: json_answer("reweighted", _VERSION), **errors(400, 401, 404, 413)},
    auth="admin",
)  # fmt: skip
ADMIN_DELETE = Operation(
    summary="Remove a version: it finishes what it holds, then unloads",
    tag="admin",
    path=_PATH,
    answers={202: json_answer("removing", _VERSION), **errors(401, 404, 409)},
    auth="admin",
)
