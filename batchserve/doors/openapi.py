"""The OpenAPI 3.1 document, derived from the routes as the doors declare them.

A door mounts a route only through `Routes.add(method, path, handler, operation)`: the
aiohttp route and its `Operation` (summary, parameters, body, answers) are one declaration,
so no route exists without its description and the description cannot drift into a copy.
`GET /openapi.json` serves the document built from the routes this app mounted (the admin
routes only with --admin-key, the dashboard only with metrics) and the security its keys
configure. Schemas are JSON Schema 2020-12 dicts, kept beside the code that reads or writes
the body; one with a "title" becomes a named component, which generated clients name after.
Every answer carries `X-Request-Id`; errors are the wire's JSON body (`ERROR`, or
`OPENAI_ERROR` on the OpenAI-shaped routes, OIP's own on OIP's), with the headers their
status brings. A field or path parameter that names a model is a `ModelName`: in the
document, an `enum` of the models of its kind that run when the document is asked for (a
model of the other kind is refused with 400, an unknown name with 404); a body's field that
may name none is required where several run. An operation whose kind of model runs nowhere
is left out (its route answers 404 then), so every published schema can be met.
`/v1/embeddings`' `dimensions` is likewise the live embedding models' one vector length
where they share one.

It is over 450 lines as the one place the document is built: each route only declares its
`Operation` beside its handler.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

import orjson
from aiohttp import web

Schema = Mapping[str, Any]
Auth = Literal["key", "admin", "operator"]
"""Who may call an operation: a key of --keys-file (or the anonymous tier), the admin key,
or an operator key (a tenant's key with operator rights, unless --public-metrics)."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Kind = Literal["batch", "embedding", "generation"]
"""A batch model, one of those that return vectors, or a generation model."""
LiveModels = Callable[[Kind], list[str]]
"""The names of the models of a kind that the engine runs now."""
LiveDimensions = Callable[[], list[int]]
"""The vector lengths of the embedding models that the engine runs now."""


@dataclass(frozen=True)
class ModelName:
    """A schema placeholder: a model of `kind`, made an `enum` of the live names of that
    kind each time the document is built; null too if `nullable` and only one runs (a body
    must name its model where several do)."""

    kind: Kind
    description: str = ""
    nullable: bool = False

    def schema(self, names: list[str] | None) -> dict[str, Any]:
        named: dict[str, Any]
        if names is None:  # not shown to this caller: any name
            named = {"type": ["string", "null"] if self.nullable else "string"}
        else:
            nullable = self.nullable and len(names) == 1
            named = {"enum": [*names, None] if nullable else names}
        if self.description:
            named["description"] = self.description
        return named


@dataclass(frozen=True)
class Dimensions:
    """A schema placeholder: an embeddings request's `dimensions`, made the `enum` of the one
    vector length the live embedding models share (or null); where their lengths differ,
    an integer whose rule is told in `description` (the named model's length, or 400)."""

    description: str

    def schema(self, lengths: list[int]) -> dict[str, Any]:
        if len(lengths) == 1:
            return {"enum": [*lengths, None], "description": self.description}
        return {"type": ["integer", "null"], "minimum": 1, "description": self.description}


@dataclass(frozen=True)
class _Live:
    """What the document says of the running models, built anew when it changes."""

    names: Mapping[Kind, list[str]] | None
    """None: the caller may not see which models run (API keys, and none it holds)."""
    dimensions: list[int]


_UNSEEN = _Live(None, [])


ERROR: Schema = {
    "title": "Error",
    "type": "object",
    "required": ["error", "message", "request_id"],
    "properties": {
        "error": {"type": "string", "description": "the code, e.g. INVALID_INPUT"},
        "message": {"type": "string", "description": "what went wrong, for a person"},
        "request_id": {"type": "string"},
        "retry_after_ms": {"type": "integer", "minimum": 1},
    },
}
OPENAI_ERROR: Schema = {
    "title": "OpenAIError",
    "type": "object",
    "required": ["error", "request_id"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {
                    "enum": ["invalid_request_error", "requests", "server_error"],
                    "description": "OpenAI's type: requests for 429, server_error for 5xx",
                },
                "param": {"type": "null"},
                "code": {"type": "string", "description": "the code, e.g. INVALID_INPUT"},
            },
        },
        "request_id": {"type": "string"},
        "retry_after_ms": {"type": "integer", "minimum": 1},
    },
}
_SECONDS = {"type": "string", "pattern": "^[0-9]+$"}
HEADERS: Mapping[str, Schema] = {
    "X-Request-Id": {"description": "the request's id: the client's, or a fresh one",
                     "required": True, "schema": {"type": "string"}},
    "Retry-After": {"description": "seconds to wait before retrying", "schema": _SECONDS},
    "WWW-Authenticate": {"required": True, "schema": {"const": "Bearer"}},
    "Allow": {"required": True, "schema": {"type": "string"}},
    "RateLimit-Limit": {"required": True, "schema": {"type": "string"}},
    "RateLimit-Remaining": {"required": True, "schema": {"const": "0"}},
    "RateLimit-Reset": {"required": True, "schema": _SECONDS},
    "Location": {"required": True, "schema": {"type": "string"}},
    "Server-Timing": {"schema": {"type": "string"}},
}  # fmt: skip
"""Every response header the API documents; an `Answer` names the ones it carries."""
_ERROR_HEADERS: Mapping[int, tuple[str, ...]] = {
    401: ("WWW-Authenticate",),
    405: ("Allow",),
    429: ("Retry-After", "RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"),
    503: ("Retry-After",),
}
_ERROR_WHEN: Mapping[int, str] = {
    400: "INVALID_INPUT: the body, a field, a parameter or X-Request-Id is not what it"
    " takes; or OVER_TIER_BURST: a list of more strings than the tier's burst",
    401: "UNAUTHENTICATED: no key, or one the server does not know",
    404: "NOT_FOUND or MODEL_NOT_FOUND: no such request, model or version",
    409: "DUPLICATE_REQUEST_ID (the id is in use) or CONFLICT (admin: the version exists,"
    " or is still loading)",
    413: "INPUT_TOO_LARGE: the input or the body is over the limit",
    429: "RATE_LIMITED: the tenant is over its tier's rate",
    500: "BACKEND_ERROR: the model failed on this input",
    503: "OVERLOADED, NOT_READY or STORE_UNAVAILABLE: retry after Retry-After",
    504: "DEADLINE_EXCEEDED: the request's deadline passed; or DEADLINE_TOO_SHORT: it is"
    " shorter than one batch call, so it can never be met",
}
_NEEDS_KEYS = frozenset({401, 429})
"""Statuses only a server with keys answers: dropped where the operation runs open."""


@dataclass(frozen=True, kw_only=True)
class Answer:
    """One status's answer: its body's media type and schema, and the headers it carries
    beyond X-Request-Id."""

    description: str
    schema: Schema | None = None
    media_type: str = "application/json"
    headers: tuple[str, ...] = ()
    more: Mapping[str, Schema] = field(default_factory=dict)
    """Other media types the same status may answer with (a stream), to their schema."""


@dataclass(frozen=True, kw_only=True)
class Operation:
    """What one route takes and answers. `path` names the schema of each path parameter
    (a string otherwise); `parameters` are OpenAPI parameter objects (query, header)."""

    summary: str
    tag: str
    answers: Mapping[int, Answer]
    body: Schema | None = None
    parameters: tuple[Schema, ...] = ()
    path: Mapping[str, Schema | ModelName] = field(default_factory=dict)
    auth: Auth | None = None
    description: str = ""


def json_answer(description: str, schema: Schema, *headers: str) -> Answer:
    return Answer(description=description, schema=schema, headers=headers)


def errors(*statuses: int, openai: bool = False, schema: Schema | None = None) -> dict[int, Answer]:
    """The error answers of `statuses` in the wire's error body (OpenAI's on its routes, or
    `schema`, a protocol's own)."""
    if schema is None:
        schema = OPENAI_ERROR if openai else ERROR
    return {
        status: Answer(
            description=_ERROR_WHEN.get(status, HTTPStatus(status).phrase),
            schema=schema,
            headers=_ERROR_HEADERS.get(status, ()),
        )
        for status in statuses
    }


def header(name: str, description: str, schema: Schema) -> Schema:
    """A request header parameter, optional."""
    return {"name": name, "in": "header", "description": description, "schema": schema}


REQUEST_ID = header(
    "X-Request-Id",
    "the request's id, echoed back (up to 128 printable characters); absent or empty, the"
    " server makes one",
    {"type": "string", "maxLength": 128, "pattern": "^[\\x20-\\x7e\\xa1-\\xac\\xae-\\xff]*$"},
)
TIMEOUT = header(
    "X-Request-Timeout-Ms",
    "the request's own timeout in ms, capped by --timeout-ms (a generation's wait for its"
    " first token: by --first-token-timeout-ms); the body's timeout_ms wins",
    {"type": "number", "exclusiveMinimum": 0},
)


@dataclass(frozen=True)
class Security:
    """Which callers each kind of `Auth` admits on this server."""

    key: bool = False
    """--keys-file: a bearer key of that file."""
    anonymous: bool = False
    """--anonymous-tier: a caller without a key is admitted too."""
    admin: bool = False
    operator: bool = False
    """the numbers (/metrics, /api/stats) need an operator key."""

    def requirement(self, auth: Auth | None) -> list[dict[str, list[str]]] | None:
        """The operation's OpenAPI security: None where it runs open."""
        if auth == "admin" and self.admin:
            return [{"adminKey": []}]
        if auth == "key" and self.key:
            return [{"apiKey": []}, {}] if self.anonymous else [{"apiKey": []}]
        if auth == "operator" and self.operator:
            return [{"apiKey": []}, {"adminKey": []}] if self.admin else [{"apiKey": []}]
        return None


class Routes:
    """An app's routes, each declared with its operation; and the document they make."""

    def __init__(
        self,
        app: web.Application,
        security: Security,
        title: str,
        version: str,
        live_models: LiveModels = lambda kind: [],
        live_dimensions: LiveDimensions = lambda: [],
        may_see_models: Callable[[str | None], bool] = lambda authorization: True,
    ) -> None:
        self._app = app
        self._security = security
        self._info = {"title": title, "version": version}
        self._live_models = live_models
        self._live_dimensions = live_dimensions
        self._may_see_models = may_see_models
        """Whether a caller (its Authorization header) may see the live model names: those
        only /api/models shows; other callers get the document without them."""
        self.operations: dict[tuple[str, str], Operation] = {}
        self._document: tuple[object, bytes] | None = None
        self._unseen_document: bytes | None = None

    def add(self, method: str, path: str, handler: Handler, operation: Operation) -> None:
        """Mounts `handler` at `method path` (a GET answers HEAD too) and records what it
        takes and answers."""
        if method == "GET":
            self._app.router.add_get(path, handler)
        else:
            self._app.router.add_route(method, path, handler)
        self.operations[method, path] = operation

    def document(self) -> dict[str, Any]:
        return self._build(self._now())

    def _now(self) -> _Live:
        kinds: tuple[Kind, ...] = ("batch", "embedding", "generation")
        names = {kind: sorted(self._live_models(kind)) for kind in kinds}
        return _Live(names, sorted(set(self._live_dimensions())))

    def _build(self, live: _Live) -> dict[str, Any]:
        paths: dict[str, dict[str, Any]] = {}
        components: dict[str, Any] = {"schemas": {}}
        for (method, path), operation in self.operations.items():
            if not _servable(operation, live):
                continue
            openapi_path = _OPENAPI_PATH.sub(r"{\1}", path)
            paths.setdefault(openapi_path, {})[method.lower()] = self._operation(
                method, path, operation, components["schemas"]
            )
        paths, components = _live(paths, live), _live(components, live)
        schemes = {}
        if self._security.key or self._security.operator:
            schemes["apiKey"] = {
                "type": "http",
                "scheme": "bearer",
                "description": "a key of --keys-file",
            }
        if self._security.admin:
            schemes["adminKey"] = {
                "type": "http",
                "scheme": "bearer",
                "description": "the --admin-key",
            }
        if schemes:
            components["securitySchemes"] = schemes
        return {
            "openapi": "3.1.0",
            "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
            "info": self._info,
            "paths": paths,
            "components": components,
        }

    async def serve(self, request: web.Request) -> web.Response:
        """GET /openapi.json: built for the models that run now (an admin may have added or
        removed one since the last ask), and kept until they change."""
        if not self._may_see_models(request.headers.get("Authorization")):
            if self._unseen_document is None:
                self._unseen_document = orjson.dumps(self._build(_UNSEEN))
            return web.Response(body=self._unseen_document, content_type="application/json")
        live = self._now()
        if self._document is None or self._document[0] != live:
            self._document = (live, orjson.dumps(self._build(live)))
        return web.Response(body=self._document[1], content_type="application/json")

    def _operation(
        self, method: str, path: str, operation: Operation, named: dict[str, Any]
    ) -> dict[str, Any]:
        security = self._security.requirement(operation.auth)
        parameters = [
            {
                "name": name,
                "in": "path",
                "required": True,
                "schema": operation.path.get(name, {"type": "string"}),
            }
            for name in _OPENAPI_PATH.findall(path)
        ] + list(operation.parameters)
        described: dict[str, Any] = {
            "operationId": _operation_id(method, path),
            "summary": operation.summary,
            "tags": [operation.tag],
            "responses": {
                str(status): self._answer(answer, named)
                for status, answer in sorted(operation.answers.items())
                if security is not None or status not in _NEEDS_KEYS
            },
        }
        if operation.description:
            described["description"] = operation.description
        if parameters:
            described["parameters"] = parameters
        if operation.body is not None:
            described["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _named(operation.body, named)}},
            }
        if security is not None:
            described["security"] = security
        return described

    @staticmethod
    def _answer(answer: Answer, named: dict[str, Any]) -> dict[str, Any]:
        described: dict[str, Any] = {
            "description": answer.description,
            "headers": {name: HEADERS[name] for name in ("X-Request-Id", *answer.headers)},
        }
        if answer.schema is not None:
            content = {answer.media_type: {"schema": _named(answer.schema, named)}}
            content |= {kind: {"schema": schema} for kind, schema in answer.more.items()}
            described["content"] = content
        return described


_OPENAPI_PATH = re.compile(r"{(\w+)(?::[^}]*)?}")
"""aiohttp's `{name:regex}` path parameter; OpenAPI's is `{name}`."""


def _operation_id(method: str, path: str) -> str:
    words = re.findall(r"\w+", _OPENAPI_PATH.sub(r"by_\1", path))
    return "_".join([method.lower(), *words]) if words else f"{method.lower()}_root"


def _named(schema: Schema, named: dict[str, Any]) -> Schema:
    """A schema with a title becomes a component, referenced by its title."""
    title = schema.get("title")
    if not isinstance(title, str):
        return schema
    named[title] = schema
    return {"$ref": f"#/components/schemas/{title}"}


def _servable(operation: Operation, live: _Live) -> bool:
    """Whether a model runs that the operation could serve: one that names a kind with no
    live model (a generation route on a server of batch models) is left out of the
    document, since no request could satisfy its `model` enum; unseen names hide nothing."""
    kinds = _kinds([operation.body, *operation.path.values()])
    return live.names is None or not kinds or any(live.names[kind] for kind in kinds)


def _kinds(schema: Any) -> set[Kind]:
    """The kinds of model that the `ModelName`s in `schema` name."""
    if isinstance(schema, ModelName):
        return {schema.kind}
    if isinstance(schema, Mapping):
        schema = list(schema.values())
    if isinstance(schema, list | tuple):
        return set().union(*(_kinds(value) for value in schema))
    return set()


def _live(schema: Any, live: _Live) -> Any:
    """`schema` with each `ModelName` in it made the enum of its kind's live names (and
    required where it may be left out only while one runs), and each `Dimensions` the live
    vector lengths."""
    if isinstance(schema, ModelName):
        return schema.schema(None if live.names is None else live.names[schema.kind])
    if isinstance(schema, Dimensions):
        return schema.schema(live.dimensions)
    if isinstance(schema, Mapping):
        made = {key: _live(value, live) for key, value in schema.items()}
        properties = schema.get("properties")
        if isinstance(properties, Mapping):
            required = list(made.get("required", []))
            required += [
                name
                for name, value in properties.items()
                if isinstance(value, ModelName)
                and value.nullable
                and live.names is not None
                and len(live.names[value.kind]) != 1
                and name not in required
            ]
            if required:
                made["required"] = required
        return made
    if isinstance(schema, list | tuple):
        return [_live(value, live) for value in schema]
    return schema
