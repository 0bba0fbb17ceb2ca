"""KServe's Open Inference Protocol (v2) over HTTP, as Triton, KServe and MLServer speak it,
so `tritonclient`, the `kserve` SDK and Kubernetes probes work unchanged.

    client = tritonclient.http.InferenceServerClient("127.0.0.1:8000")
    text = tritonclient.http.InferInput("input", [2], "BYTES")
    text.set_data_from_numpy(numpy.array([b"a cat", b"a dog"], dtype=object))
    client.infer("default", [text]).as_numpy("output")

Every batch model is a model of the protocol with one input tensor, `input`, and one output,
`output`, both `BYTES` of shape [-1]: a request's tensor is [N] or [N, 1] strings, and each
string is one engine request (`Engine.infer_all`, as an embeddings list): batched with
everyone else's, answered in order in an output of the request's shape. An output that is
not a string goes out as its JSON text. Health answers 200 for true and 400 for false (the
protocol's 4xx). Errors are the protocol's `{"error": message}` with our status codes and
headers, plus `code` and `request_id`. Triton's binary tensor extension (tritonclient's
default) is read and written (`oip_binary.py`); the bodies' JSON Schemas, for /openapi.json,
are `oip_schemas.py`'s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson
from aiohttp import web

from .. import __version__
from ..batching.request import Ask
from ..engine.requests import MAX_INPUTS_PER_CALL
from ..errors import BatchserveError, InvalidInput, ModelNotFound
from ..models.specs import MAX_NAME
from .face import BatchFace
from .oip_binary import binary_response, read_with_binary
from .oip_schemas import (
    ERROR_SCHEMA,
    INFER_REQUEST_SCHEMA,
    INFER_RESPONSE_SCHEMA,
    INPUT,
    METADATA_SCHEMA,
    OUTPUT,
    SERVER_METADATA_SCHEMA,
)
from .openapi import (
    REQUEST_ID,
    TIMEOUT,
    Answer,
    ModelName,
    Operation,
    Routes,
    errors,
    json_answer,
)
from .wire import (
    error_response,
    json_response,
    read_call,
    refuse_unknown_fields,
    request_id_of,
    timeout_ms_of,
)

ROUTE = "oip"
"""The route's name in metrics and the access log."""
EXTENSIONS = ["binary_tensor_data"]
INFER_LIKE = '{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["..."]}]}'
"""What an inference request's body looks like, for one that does not."""
_REQUEST_FIELDS = frozenset({"id", "parameters", "inputs", "outputs"})
_INPUT_FIELDS = frozenset({"name", "shape", "datatype", "parameters", "data"})
_OUTPUT_FIELDS = frozenset({"name", "parameters"})
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def _answers(ok: Answer, *statuses: int) -> dict[int, Answer]:
    return {200: ok, **errors(*statuses, schema=ERROR_SCHEMA)}


_EMPTY = Answer(description="yes: an empty body")
_NOT_READY = "no (the protocol's 4xx): why, in the protocol's error body"
_MODEL = ModelName("batch", "a batch model (GET /api/models lists them)")
_INFER_ERRORS = (400, 401, 404, 409, 413, 429, 500, 503, 504)
_BINARY_NOTE = (
    "Triton's binary tensor extension (a body of an Inference-Header-Content-Length-byte"
    " JSON header, then the tensors' bytes) is read and written too, but is not described"
    " here: OpenAPI cannot say where the JSON ends. A JSON request asking for a binary"
    " output (binary_data_output or an output's binary_data) gets an"
    " application/octet-stream answer of that shape."
)
_INFERRED = Answer(
    description="one output string for each input string, in order",
    schema=INFER_RESPONSE_SCHEMA,
    more={"application/octet-stream": {"type": "string", "contentMediaType":
          "application/octet-stream"}},
)  # fmt: skip
_M, _V = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"


def _operation(
    summary: str, answers: dict[int, Answer], *, model: bool = False, **more: Any
) -> Operation:
    """An OIP operation; on a model's path, for a caller with a key, the model a live one."""
    if model:
        more |= {"path": {"model": _MODEL}, "auth": "key"}
    return Operation(summary=summary, tag="oip", answers=answers, **more)


ROUTES: tuple[tuple[str, str, str, Operation], ...] = (
    ("GET", "/v2", "server_metadata", _operation(
        "OIP server metadata", _answers(json_answer("the server", SERVER_METADATA_SCHEMA)))),
    ("GET", "/v2/health/live", "live", _operation("OIP server live", _answers(_EMPTY))),
    ("GET", "/v2/health/ready", "ready", _operation("OIP server ready", {
        200: _EMPTY, 400: Answer(description=_NOT_READY, schema=ERROR_SCHEMA)})),
    ("GET", _M, "model_metadata", _operation(
        "OIP model metadata", _answers(json_answer("the model", METADATA_SCHEMA), 401, 404),
        model=True)),
    ("GET", _V, "model_metadata", _operation(
        "OIP model version metadata",
        _answers(json_answer("the model", METADATA_SCHEMA), 401, 404), model=True)),
    ("GET", f"{_M}/ready", "model_ready", _operation(
        "OIP model ready: a version of it is", {
            200: _EMPTY, 400: Answer(description=_NOT_READY, schema=ERROR_SCHEMA),
            **errors(401, 404, schema=ERROR_SCHEMA)}, model=True)),
    ("GET", f"{_V}/ready", "model_ready", _operation(
        "OIP model version ready", {
            200: _EMPTY, 400: Answer(description=_NOT_READY, schema=ERROR_SCHEMA),
            **errors(401, 404, schema=ERROR_SCHEMA)}, model=True)),
    ("POST", f"{_M}/infer", "infer", _operation(
        "OIP inference: each string of the input tensor is one request to the model",
        _answers(_INFERRED, *_INFER_ERRORS), body=INFER_REQUEST_SCHEMA,
        parameters=(REQUEST_ID, TIMEOUT), description=_BINARY_NOTE, model=True)),
    ("POST", f"{_V}/infer", "infer", _operation(
        "OIP inference on a version", _answers(_INFERRED, *_INFER_ERRORS),
        body=INFER_REQUEST_SCHEMA, parameters=(REQUEST_ID, TIMEOUT),
        description=_BINARY_NOTE, model=True)),
)  # fmt: skip
"""Every route of the protocol (method, path, the name of `OipApi`'s method that answers it,
its operation), declared once: `mount` adds them to the routes that /openapi.json reads."""


class Tensors(NamedTuple):
    """An inference request, read: the strings of its input, its shape, and how to answer."""

    texts: list[str]
    shape: list[int]
    id: str | None
    binary: bool
    timeout_ms: float | None


def error_shape(error: BatchserveError, request_id: str) -> dict[str, Any]:
    return {"error": str(error), "code": error.code, "request_id": request_id}


class OipApi:
    def __init__(self, engine: BatchFace) -> None:
        self._engine = engine

    def mount(self, routes: Routes) -> None:
        for method, path, handler, operation in ROUTES:
            routes.add(method, path, getattr(self, handler), operation)

    async def server_metadata(self, request: web.Request) -> web.Response:
        body = {"name": "batchserve", "version": __version__, "extensions": EXTENSIONS}
        return json_response(200, body)

    async def live(self, request: web.Request) -> web.Response:
        return web.Response()

    async def ready(self, request: web.Request) -> web.Response:
        """Serving with a healthy device, as /readyz (the result store aside: no OIP route
        uses it)."""
        ready, status = self._engine.readiness()
        return web.Response() if ready else _not_ready(f"the server is not ready: {status}")

    async def model_metadata(self, request: web.Request) -> web.Response:
        try:
            name, versions = self._model(request)
        except BatchserveError as error:
            return error_response(error, request_id_of(request)[0], shape=error_shape)
        tensor: dict[str, Any] = {"datatype": "BYTES", "shape": [-1]}
        body = {
            "name": name,
            "versions": sorted(versions),
            "platform": "batchserve",
            "inputs": [{"name": INPUT, **tensor}],
            "outputs": [{"name": OUTPUT, **tensor}],
        }
        return json_response(200, body)

    async def model_ready(self, request: web.Request) -> web.Response:
        """200 while the server is ready and the version (any, when none is named) is."""
        try:
            name, versions = self._model(request)
        except BatchserveError as error:
            return error_response(error, request_id_of(request)[0], shape=error_shape)
        ready, status = self._engine.readiness()
        if not ready:
            return _not_ready(f"the server is not ready: {status}")
        if "ready" not in versions.values():
            states = ", ".join(f"{v} {state}" for v, state in sorted(versions.items()))
            return _not_ready(f"model {name} is not ready ({states})")
        return web.Response()

    def _model(self, request: web.Request) -> tuple[str, dict[str, str]]:
        """The model's name and its versions' states (only the path's version, if it names
        one); 404 for no such model or version, 401 for a caller without a key."""
        self._engine.authenticate(request.headers.get("Authorization"))
        name, version = request.match_info["model"], request.match_info.get("version")
        for model in self._engine.view.models():
            if model["name"] != name:
                continue
            versions = {
                v["version"]: v["state"]
                for v in model["versions"]
                if v["kind"] == "batch" and v["state"] != "draining"
            }
            if not versions:
                raise ModelNotFound(
                    f"model {name} generates text; this protocol serves batch models"
                    " (POST /v1/completions)"
                )
            if version is None:
                return name, versions
            if version in versions:
                return name, {version: versions[version]}
            raise ModelNotFound(
                f"model {name} has no version {version[:MAX_NAME]!r};"
                f" it has {', '.join(sorted(versions))}"
            )
        raise ModelNotFound(f"no model {name[:MAX_NAME]!r} (GET /api/models lists them)")

    async def infer(self, request: web.Request) -> web.Response:
        call = await read_call(
            request, self._engine, ROUTE, read_tensors_request,
            like=INFER_LIKE, read=read_with_binary, shape=error_shape,
        )  # fmt: skip
        if isinstance(call, web.Response):
            return call
        request_id, asked = call.request_id, call.body
        model, version = request.match_info["model"], request.match_info.get("version")
        asks = [Ask(text, asked.timeout_ms, model, version) for text in asked.texts]
        try:
            results = await self._engine.infer_all(asks, call.caller)
        except BatchserveError as error:
            return error_response(error, request_id, shape=error_shape)
        outputs = [_as_text(result.output) for result in results]
        output: dict[str, Any] = {"name": OUTPUT, "datatype": "BYTES", "shape": asked.shape}
        head: dict[str, Any] = {"model_name": results[0].model}
        versions = {r.version for r in results}
        if len(versions) == 1:  # unpinned, the strings may have run on different versions
            head["model_version"] = versions.pop()
        if asked.id is not None:
            head["id"] = asked.id
        head["outputs"] = [output]
        headers = {"X-Request-Id": request_id}
        if not asked.binary:
            output["data"] = outputs
            return json_response(200, head, headers)
        return binary_response(head, output, outputs, headers)


def _not_ready(why: str) -> web.Response:
    return json_response(400, {"error": why})


def _as_text(output: Any) -> str:
    """A BYTES element: the output if it is a string, else its JSON text."""
    return output if isinstance(output, str) else orjson.dumps(output, option=_NUMPY).decode()


def read_tensors_request(payload: dict[str, Any], request: web.Request) -> Tensors:
    """The request's one BYTES input of shape [N] or [N, 1] (flat or nested data), checked
    for shape; the engine checks each string as it checks any input."""
    refuse_unknown_fields(payload, _REQUEST_FIELDS)
    given_id = payload.get("id")
    if given_id is not None and not isinstance(given_id, str):
        raise InvalidInput('"id" must be a string')
    parameters = _parameters(payload, "the request")
    inputs = payload.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise InvalidInput(f'"inputs" must hold one tensor, "{INPUT}": the model takes one')
    tensor = inputs[0]
    refuse_unknown_fields(tensor, _INPUT_FIELDS)
    if tensor.get("name") != INPUT:
        raise InvalidInput(f'the input tensor must be named "{INPUT}" (see the model metadata)')
    if tensor.get("datatype") != "BYTES":
        raise InvalidInput(f'input "{INPUT}" must have datatype "BYTES" (strings)')
    _parameters(tensor, f'input "{INPUT}"')
    shape = tensor.get("shape")
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape)
        or shape[1:] not in ([], [1])
        or shape[0] < 1
    ):
        raise InvalidInput(f'input "{INPUT}" must have shape [N] or [N, 1], N at least 1')
    if shape[0] > MAX_INPUTS_PER_CALL:
        raise InvalidInput(
            f'input "{INPUT}" holds {shape[0]} strings; the limit is {MAX_INPUTS_PER_CALL}'
        )
    data = tensor.get("data")
    if isinstance(data, list) and all(isinstance(row, list) and len(row) == 1 for row in data):
        data = [row[0] for row in data]  # [N, 1] in its natural, nested form
    if not isinstance(data, list) or not all(isinstance(text, str) for text in data):
        raise InvalidInput(f'input "{INPUT}" needs "data": a list of strings')
    if len(data) != shape[0]:
        raise InvalidInput(f'input "{INPUT}" has {len(data)} strings for shape {shape}')
    binary = parameters.get("binary_data_output") is True
    outputs = payload.get("outputs")
    if outputs is not None and not isinstance(outputs, list):
        raise InvalidInput('"outputs" must be a list')
    for wanted in outputs or []:
        if not isinstance(wanted, dict):
            raise InvalidInput('each of "outputs" must be an object with a "name"')
        refuse_unknown_fields(wanted, _OUTPUT_FIELDS)
        if wanted.get("name") != OUTPUT:
            raise InvalidInput(f'the model has one output, "{OUTPUT}"')
        binary = _parameters(wanted, f'output "{OUTPUT}"').get("binary_data", binary) is True
    return Tensors(data, shape, given_id, binary, _timeout_ms(parameters, request))


def _parameters(holder: dict[str, Any], what: str) -> dict[str, Any]:
    parameters = holder.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput(f'"parameters" of {what} must be an object')
    return parameters


def _timeout_ms(parameters: dict[str, Any], request: web.Request) -> float | None:
    """Triton's "timeout" parameter (microseconds), else X-Request-Timeout-Ms, else None."""
    timeout_us = parameters.get("timeout")
    if timeout_us is not None and (
        isinstance(timeout_us, bool) or not isinstance(timeout_us, int | float) or timeout_us <= 0
    ):
        raise InvalidInput('parameter "timeout" must be a number of microseconds above 0')
    return timeout_ms_of(None if timeout_us is None else timeout_us / 1e3, request)
