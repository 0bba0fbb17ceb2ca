"""`POST /api/inference`, the fast door, and the probes a load balancer asks: `/healthz`,
`/readyz`, and `GET /api/models`.

The door runs the engine's `infer` in its parts (`admit`, await the request's future,
`settle`) so that no coroutine or parsed call outlives the admission: a same-run A/B shows
it pays (benchmarks/README.md, section 4). `runner.py` hands it its requests ahead of
aiohttp's routing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from ..batching.request import Result
from ..errors import BatchserveError
from .face import BatchFace
from .openapi import REQUEST_ID, TIMEOUT, Operation, errors, json_answer
from .wire import (
    INFERENCE_ANSWER,
    INFERENCE_BODY,
    INPUT_LIKE,
    answer_response,
    error_response,
    json_response,
    parse_input,
    read_call,
    request_id_of,
)


class InferenceApi:
    """POST /api/inference, and the probes a load balancer asks. `store_problem` says why
    the result store cannot be used now (None while it can), for /readyz."""

    def __init__(
        self, engine: BatchFace, store_problem: Callable[[], Awaitable[str | None]] | None = None
    ) -> None:
        self._engine = engine
        self._store_problem = store_problem

    async def inference(self, request: web.BaseRequest) -> web.Response:
        engine = self._engine
        call = await read_call(request, engine, "inference", parse_input, like=INPUT_LIKE)
        if isinstance(call, web.Response):
            return call
        request_id, tenant, ask, arrival, _ = call
        # `engine.infer` in parts (admit, await, settle), and nothing more bound than the
        # request: each object a request keeps for its wait, `infer`'s coroutine as much as
        # the parsed call, costs the loop (benchmarks/README.md, section 4).
        del call
        try:
            queued, expiry = engine.admit("inference", ask, request_id, tenant, arrival)
        except BatchserveError as error:
            return error_response(error, request_id)
        del ask
        outcome: Result | BatchserveError | None = None
        try:
            outcome = result = await queued.future
        except BatchserveError as error:
            outcome = error
            return error_response(error, request_id)
        finally:
            engine.settle("inference", queued, expiry, tenant, outcome)
        return answer_response(request_id, result, engine.clock.time() - arrival)

    async def models(self, request: web.Request) -> web.Response:
        """GET /api/models: each model, its versions, devices, weights and state; with
        API keys, for a caller with a key (or the anonymous tier)."""
        try:
            self._engine.authenticate(request.headers.get("Authorization"))
        except BatchserveError as error:
            return error_response(error, request_id_of(request)[0])
        return json_response(200, {"models": self._engine.view.models()})

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response(200, {"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready while serving with at least one healthy device and a result store that
        answers; lists each device, and the store's problem if it has one."""
        ready, status = self._engine.readiness()
        body: dict[str, object] = {"status": status, "devices": self._engine.device_states()}
        if ready and self._store_problem is not None:
            problem = await self._store_problem()
            if problem is not None:
                ready = False
                body.update(status="result store unavailable", result_store=problem)
        return json_response(200 if ready else 503, body)


INFERENCE = Operation(
    summary="Run one input through a model, answered on the same connection",
    tag="inference",
    parameters=(REQUEST_ID, TIMEOUT),
    body=INFERENCE_BODY,
    answers={
        200: json_answer("the model's output and timings", INFERENCE_ANSWER, "Server-Timing"),
        **errors(400, 401, 404, 409, 413, 429, 500, 503, 504),
    },
    auth="key",
)
MODEL_LIST = {
    "title": "ModelList",
    "type": "object",
    "required": ["models"],
    "properties": {"models": {"type": "array", "items": {
        "type": "object",
        "required": ["name", "versions"],
        "properties": {"name": {"type": "string"}, "versions": {"type": "array", "items": {
            "type": "object",
            "required": ["version", "state", "kind"],
            "properties": {"version": {"type": "string"}, "state": {"type": "string"},
                           "kind": {"enum": ["batch", "generation"]}},
        }}},
    }}},
}  # fmt: skip
MODELS = Operation(
    summary="Each model, its versions, devices, weights and state",
    tag="models",
    answers={200: json_answer("the models", MODEL_LIST), **errors(401)},
    auth="key",
)
HEALTHZ = Operation(
    summary="Liveness: the process answers",
    tag="health",
    answers={200: json_answer("alive", {"type": "object", "properties": {
        "status": {"const": "alive"}}, "required": ["status"]})},
)  # fmt: skip
_READINESS = {
    "title": "Readiness",
    "type": "object",
    "required": ["status", "devices"],
    "properties": {
        "status": {"type": "string"},
        "devices": {"type": "object", "additionalProperties": {"type": "string"},
                    "description": "each device's state"},
        "result_store": {"type": "string", "description": "why the result store fails"},
    },
}  # fmt: skip
READYZ = Operation(
    summary="Readiness: serving, with a healthy device and a result store that answers",
    tag="health",
    answers={200: json_answer("ready", _READINESS), 503: json_answer("not ready", _READINESS)},
)
OPENAPI = Operation(
    summary="This document: every route this server mounted, its body and answers",
    tag="health",
    answers={200: json_answer("the OpenAPI 3.1 document", {"type": "object"})},
)
