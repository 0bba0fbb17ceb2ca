"""The OpenAI-shaped door: `POST /v1/embeddings`, `GET /v1/models` and `/v1/models/{id}`,
so OpenAI client libraries work unchanged (generation: `openai_completions.py`).

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.embeddings.create(model="minilm", input=["a", "b"]).data[0].embedding

Each input of a request is one engine request: inputs batch with everyone else's of the same
model (and may land in different batches), and the answer lists them in the order given.
Errors keep our status codes and carry OpenAI's body shape, which its clients raise as typed
exceptions. Vectors go out as floats, or as base64 of little-endian float32 when asked (the
official Python client asks for that by default).
"""

from __future__ import annotations

import array
import base64
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..batching.request import Ask, Result
from ..engine.requests import MAX_INPUTS_PER_CALL
from ..errors import BatchserveError, InvalidInput, ModelNotFound
from ..models.specs import MAX_NAME
from .face import BatchFace
from .openapi import REQUEST_ID, Dimensions, ModelName, Operation, errors, json_answer
from .tei_bodies import cut, dimensions_of
from .wire import (
    error_response,
    json_response,
    read_call,
    refuse_unknown_fields,
    request_id_of,
)

MAX_EMBEDDING_INPUTS = MAX_INPUTS_PER_CALL
"""OpenAI's own limit on inputs per embeddings request."""
EMBEDDINGS_LIKE = '{"model": "...", "input": "..." or ["...", ...]}'
_EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "user", "dimensions"})


class OpenAIApi:
    def __init__(self, engine: BatchFace) -> None:
        self._engine = engine

    async def embeddings(self, request: web.Request) -> web.Response:
        engine = self._engine
        call = await read_call(
            request, engine, "embeddings", self._parse_embeddings,
            like=EMBEDDINGS_LIKE, openai_shape=True,
        )  # fmt: skip
        if isinstance(call, web.Response):
            return call
        request_id, (model, texts, base64_wanted, size) = call.request_id, call.body
        asks = [Ask(text, model=model) for text in texts]
        try:
            results = await engine.infer_all(asks, call.caller)
        except BatchserveError as error:
            return error_response(error, request_id, openai_shape=True)
        tokens = sum(engine.view.count_tokens(r, t) for r, t in zip(results, texts, strict=True))
        body = embeddings_answer(model, results, tokens, base64_wanted=base64_wanted, size=size)
        return json_response(200, body, {"X-Request-Id": request_id})

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: every model this server runs, batch and generation; with API
        keys, for a caller with a key (or the anonymous tier)."""
        try:
            self._engine.authenticate(request.headers.get("Authorization"))
        except BatchserveError as error:
            return error_response(error, request_id_of(request)[0], openai_shape=True)
        data = [_model_object(model["name"]) for model in self._engine.view.models()]
        return json_response(200, {"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: one model's object (`client.models.retrieve`), or 404;
        with API keys, for a caller with a key, as the list."""
        request_id, _ = request_id_of(request)
        try:
            self._engine.authenticate(request.headers.get("Authorization"))
        except BatchserveError as error:
            return error_response(error, request_id, openai_shape=True)
        name = request.match_info["model"]
        if any(model["name"] == name for model in self._engine.view.models()):
            return json_response(200, _model_object(name))
        unknown = ModelNotFound(f"no model {name[:MAX_NAME]!r} (GET /v1/models lists them)")
        return error_response(unknown, request_id, openai_shape=True)

    def _parse_embeddings(
        self, payload: dict[str, Any], request: web.Request
    ) -> tuple[str, list[str], bool, int | None]:
        """The model (one that returns vectors), the inputs, whether base64 is wanted, and
        the Matryoshka size to cut the vectors to (None: as they are)."""
        view = self._engine.view
        return embeddings_request(payload, view.embedding_dim, view.dimensions)


def embeddings_answer(
    model: str,
    results: list[Result],
    tokens: int,
    *,
    base64_wanted: bool,
    size: int | None,
) -> dict[str, Any]:
    """The answer to an embeddings request (a Batch API line's output too)."""
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": _encoded(vector) if base64_wanted else vector,
            }
            for index, vector in enumerate(cut(r.output, size, True) for r in results)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def embeddings_request(
    payload: dict[str, Any],
    embedding_dim: Callable[[str], int],
    dimensions: Callable[[str], frozenset[int]],
) -> tuple[str, list[str], bool, int | None]:
    """An embeddings body read (online or a Batch API line): the model, the inputs, whether
    base64 is wanted, and the Matryoshka size (None: as they are)."""
    model, texts, base64_wanted = _embeddings_request(payload)
    embedding_dim(model)
    size = dimensions_of(payload, lambda: dimensions(model))
    return model, texts, base64_wanted, size


def _embeddings_request(payload: dict[str, Any]) -> tuple[str, list[str], bool]:
    """The model, the inputs and whether base64 is wanted, checked for shape."""
    refuse_unknown_fields(payload, _EMBEDDING_FIELDS)
    model = payload.get("model")
    if not isinstance(model, str):
        raise InvalidInput('the body needs a string field "model"')
    given = payload.get("input")
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        raise InvalidInput('"input" must be a string or a non-empty list of strings')
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise InvalidInput(
            f'"input" holds {len(texts)} strings; the limit is {MAX_EMBEDDING_INPUTS}'
        )
    encoding = payload.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise InvalidInput('"encoding_format" must be "float" or "base64"')
    return model, texts, encoding == "base64"


def _model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "batchserve"}


def _encoded(vector: list[float]) -> str:
    packed = array.array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()


MODEL_OBJECT = {
    "title": "Model",
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                   "created": {"type": "integer"}, "owned_by": {"type": "string"}},
}  # fmt: skip
EMBEDDINGS = Operation(
    summary="OpenAI's embeddings: one vector per input, in the order given",
    tag="openai",
    parameters=(REQUEST_ID,),
    body={
        "title": "EmbeddingsRequest",
        "type": "object",
        "required": ["model", "input"],
        "additionalProperties": False,
        "properties": {
            "model": ModelName("embedding", "a model that returns vectors"),
            "input": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {"type": "string"},
                        "minItems": 1,
                        "maxItems": MAX_EMBEDDING_INPUTS,
                        "description": "with API keys, at most the tier's burst of strings"
                        " (400 OVER_TIER_BURST otherwise), a rule JSON Schema cannot state",
                    },
                ]
            },
            "encoding_format": {"enum": ["float", "base64"]},
            "user": {},
            "dimensions": Dimensions(
                "the named model's vector length (or null); another is 400. It is the enum of"
                " the one length where every embedding model that runs shares it"
            ),
        },
    },
    answers={
        200: json_answer(
            "the vectors",
            {
                "title": "Embeddings",
                "type": "object",
                "required": ["object", "data", "model", "usage"],
                "properties": {
                    "object": {"const": "list"},
                    "data": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["object", "index", "embedding"],
                            "properties": {
                                "object": {"const": "embedding"},
                                "index": {"type": "integer", "minimum": 0},
                                "embedding": {
                                    "anyOf": [
                                        {"type": "array", "items": {"type": "number"}},
                                        {"type": "string", "contentEncoding": "base64"},
                                    ]
                                },
                            },
                        },
                    },
                    "model": {"type": "string"},
                    "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"]},
                },
            },
        ),
        **errors(400, 401, 404, 409, 413, 429, 500, 503, 504, openai=True),
    },
    auth="key",
)
OPENAI_MODELS = Operation(
    summary="OpenAI's model list: every model this server runs",
    tag="openai",
    answers={
        200: json_answer(
            "the models",
            {
                "title": "ModelObjects",
                "type": "object",
                "required": ["object", "data"],
                "properties": {
                    "object": {"const": "list"},
                    "data": {"type": "array", "items": MODEL_OBJECT},
                },
            },
        ),
        **errors(401, openai=True),
    },
    auth="key",
)
OPENAI_MODEL = Operation(
    summary="OpenAI's model object of one model",
    tag="openai",
    answers={200: json_answer("the model", MODEL_OBJECT), **errors(401, 404, openai=True)},
    auth="key",
)
