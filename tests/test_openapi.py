"""/openapi.json: derived from the routes as declared, and held to by Schemathesis.

Schemathesis (the real tool, its CLI) runs against a live server over every operation with
its default checks; the run is bounded (a few examples an operation, one worker) and
deterministic, and must find nothing. Where its rule cannot fit this API, the exception is
named in `_CONFIG` with its reason.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson
import pytest

from batchserve.config import Config
from batchserve.doors.admin_api import PUT_BODY
from batchserve.doors.openai_fields import _COMPLETION_NEUTRAL, _NEUTRAL_SCHEMAS
from batchserve.engine.core import Engine
from batchserve.models.specs import FIELDS
from batchserve.server import ROUTES_KEY, create_app

from .conftest import HANG_GUARD_S, TWO_TENANT_KEYS, BatchserveTestServer

MODELS = """
[[model]]
name = "reverse"
version = "1"
devices = "sim:2"

[[model]]
name = "embedder"
version = "1"
fn_per_device = "tests.sample_models:tiny_embedder"
devices = "sim:2"

[[model]]
name = "writer"
version = "1"
generator = "sim"
devices = "sim:1"
"""
_POSITIVE_WITH_400 = '["2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx"]'
_CONFIG = f"""
[checks.not_a_server_error]
# 504 DEADLINE_EXCEEDED is the answer to a client's own deadline of a few microseconds
# (timeout_ms 5e-324 is schema-valid): asked for, not a fault. 500 and 503 still fail.
expected-statuses = ["2xx", "3xx", "4xx", "504"]

# Below, the exceptions: each names the operations and the rule. The first five are rules
# JSON Schema cannot state; the document states each in the field's description, and a
# schema-valid request that breaks one is 400.
[[operations]]
# OIP: an input's shape [N] or [N, 1] must match the N strings of its data; with keys, N is
# at most the tier's burst.
include-path-regex = "^/v2/models/[{{]model[}}](/versions/[{{]version[}}])?/infer$"
checks.positive_data_acceptance.expected-statuses = {_POSITIVE_WITH_400}

[[operations]]
# Generation: min_tokens at most max_tokens (the request's, or the default it gets).
include-path = ["/v1/completions", "/v1/chat/completions", "/api/generate"]
checks.positive_data_acceptance.expected-statuses = {_POSITIVE_WITH_400}

[[operations]]
# Embeddings: dimensions must be the named model's (the document's enum is the one length
# only where every embedding model shares it); with keys, a list is at most the tier's burst.
include-path = "/v1/embeddings"
checks.positive_data_acceptance.expected-statuses = {_POSITIVE_WITH_400}

[[operations]]
# Retrieval: a route serves only a model that exposes a tokenizer, of the route's kind (no
# model here does: 400), and an input over the model's length is 413 unless truncated.
include-path = ["/embed", "/rerank", "/predict", "/tokenize", "/decode", "/info", "/v1/rerank",
                "/v2/rerank"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "404", "413", "429"]

[[operations]]
# A batch request's params: only the keyword arguments its model's function takes (the
# simulated default takes none), which differ by model and version.
include-path = ["/api/inference", "/api/requests"]
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = {_POSITIVE_WITH_400}

[[operations]]
# Admin PUT: fn and fn_per_device not both, max_batch_tokens needs cost "length", the
# path's name and version are plain names, fn must import, devices must be the server's.
include-path = "/admin/models/{{name}}/versions/{{version}}"
include-method = "PUT"
checks.positive_data_acceptance.expected-statuses = {_POSITIVE_WITH_400}

[[operations]]
# With keys, a batch request predicted to miss its deadline is refused at once with 503
# OVERLOADED and Retry-After, and one whose deadline is shorter than a single call with 504
# DEADLINE_TOO_SHORT (docs/http-api.md, Shedding), rather than queued to time out: the
# documented answers, not faults.
include-path-regex = "^/(api/inference|api/requests|v1/embeddings|v2/models/.*/infer)$"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503", "504"]

[[operations]]
# A header the operation does not declare (x-schemathesis-unknown-property) is ignored, as
# RFC 9110 section 5.1 asks of a server, so a request that adds one is rightly answered:
# Schemathesis's negative_data_rejection would call that a failure. It cannot leave out
# only headers, so no undeclared parameters are made up for this operation.
include-path = "/api/requests"
include-method = "POST"
generation.allow-extra-parameters = false
"""
ST = Path(sys.executable).with_name("st")


def _engine(tmp_path: Path, **settings: object) -> Engine:
    models = tmp_path / "models.toml"
    models.write_text(MODELS)
    config = Config(models=str(models), sim_step_ms=(0.0, 0.0), **settings)  # type: ignore[arg-type]
    return Engine(config)


@pytest.mark.parametrize("admin_key", [None, "adm"])
async def test_every_route_has_an_operation_and_every_operation_a_route(tmp_path, admin_key):
    """With a model of every kind running (an embedding model is one once it has loaded)."""
    engine = _engine(tmp_path, admin_key=admin_key)
    async with engine:
        app = create_app(engine)
        document = app[ROUTES_KEY].document()
    routed = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    } - {("*", "/{path}")}  # the JSON 404 and 405 for what no route serves
    described = {
        (method.upper(), path) for path, item in document["paths"].items() for method in item
    }
    assert described == routed
    assert len(described) == len(app[ROUTES_KEY].operations)
    assert ("PUT" in {method for method, _ in described}) == (admin_key is not None)


def test_the_neutral_fields_schemas_name_exactly_the_fields_ruled():
    assert set(_NEUTRAL_SCHEMAS) == set(_COMPLETION_NEUTRAL)


async def _schemathesis(
    aiohttp_client, tmp_path: Path, engine: Engine, *options: str, headers: tuple[str, ...] = ()
) -> None:
    client = await aiohttp_client(BatchserveTestServer(create_app(engine)))
    config = tmp_path / "schemathesis.toml"
    config.write_text(_CONFIG)
    url = str(client.server.make_url("/openapi.json"))
    assert url.startswith("http://127.0.0.1:")
    args = [str(ST), "--config-file", str(config), "--no-color", "run", url, *options]
    args += ["--max-examples", "8", "--generation-deterministic", "--workers", "1"]
    # Each request's limit is the hang guard, not Schemathesis's 10 s: a loaded machine is
    # slow, and only a wedged server should fail here.
    args += ["--request-timeout", str(HANG_GUARD_S)]
    for header in headers:
        args += ["-H", header]
    run = await asyncio.create_subprocess_exec(
        *args, cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await run.communicate()
    report = output.decode(errors="replace")
    assert run.returncode == 0, report
    assert "Selected: " in report, report


async def test_schemathesis_finds_nothing_on_a_server_without_keys(aiohttp_client, tmp_path):
    await _schemathesis(aiohttp_client, tmp_path, _engine(tmp_path))


async def test_schemathesis_finds_nothing_on_a_server_with_keys(aiohttp_client, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(TWO_TENANT_KEYS)
    engine = _engine(tmp_path, keys_file=str(keys))
    await _schemathesis(
        aiohttp_client, tmp_path, engine, headers=("Authorization: Bearer sk-alice",)
    )


async def test_schemathesis_finds_nothing_in_the_admin_routes(aiohttp_client, tmp_path):
    """On a server of their own: the versions a PUT adds would change the model names of
    the document another run loaded at its start."""
    engine = _engine(tmp_path, admin_key="adm")
    await _schemathesis(
        aiohttp_client, tmp_path, engine, "--include-tag", "admin",
        headers=("Authorization: Bearer adm",),
    )  # fmt: skip


async def test_a_model_field_lists_the_live_models_its_route_serves(tmp_path):
    """A model of the other kind is 400, so the document names only the route's kind."""
    engine = _engine(tmp_path)
    async with engine:  # a model's vectors are known once it has loaded
        document = create_app(engine)[ROUTES_KEY].document()
    schemas, paths = document["components"]["schemas"], document["paths"]
    assert schemas["CompletionRequest"]["properties"]["model"] == {"enum": ["writer"]}
    assert schemas["ChatCompletionRequest"]["properties"]["model"] == {"enum": ["writer"]}
    assert schemas["InferenceRequest"]["properties"]["model"]["enum"] == ["embedder", "reverse"]
    assert schemas["EmbeddingsRequest"]["properties"]["model"]["enum"] == ["embedder"]
    # two batch models run: a body must name one; one generation model: it may name none
    assert "model" in schemas["InferenceRequest"]["required"]
    assert "model" not in schemas["GenerateRequest"].get("required", [])
    dimensions = schemas["EmbeddingsRequest"]["properties"]["dimensions"]
    assert dimensions["enum"] == [3, None]  # tiny_embedder's one vector length
    infer = paths["/v2/models/{model}/infer"]["post"]["parameters"][0]
    assert (infer["name"], infer["schema"]["enum"]) == ("model", ["embedder", "reverse"])


async def test_with_keys_only_a_caller_with_one_sees_the_model_names(aiohttp_client, tmp_path):
    """/api/models shows the names only to a caller with a key: so does the document."""
    keys = tmp_path / "keys.toml"
    keys.write_text(TWO_TENANT_KEYS)
    client = await aiohttp_client(
        BatchserveTestServer(create_app(_engine(tmp_path, keys_file=str(keys))))
    )
    assert (await client.get("/api/models")).status == 401
    unseen = await client.get("/openapi.json")
    assert unseen.status == 200
    text = await unseen.text()
    assert "reverse" not in text
    assert "writer" not in text
    model = orjson.loads(text)["components"]["schemas"]["InferenceRequest"]["properties"]
    assert model["model"]["type"] == ["string", "null"]
    seen = await client.get("/openapi.json", headers={"Authorization": "Bearer sk-alice"})
    assert "reverse" in await seen.text()


def test_the_admin_put_body_names_the_fields_a_batch_version_takes(tmp_path):
    body = create_app(_engine(tmp_path, admin_key="adm"))[ROUTES_KEY].document()["paths"][
        "/admin/models/{name}/versions/{version}"
    ]["put"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/VersionSpec"}
    assert PUT_BODY["additionalProperties"] is False
    # a generation model is added only by --models and a restart (a PUT of one is 400)
    assert set(PUT_BODY["properties"]) == FIELDS - {"generator"}


async def test_the_default_server_publishes_only_what_it_can_serve(tmp_path):
    """`python -m batchserve` runs one batch model: no route of a kind it lacks is in the
    document, so no published `model` is an enum that no request can meet."""
    engine = Engine(Config(sim_step_ms=(0.0, 0.0)))
    async with engine:
        document = create_app(engine)[ROUTES_KEY].document()
    published = set(document["paths"])
    assert {"/api/inference", "/v2/models/{model}/infer"} <= published
    assert not published & {
        "/api/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
    }  # fmt: skip
    assert b'"enum":[]' not in orjson.dumps(document)


async def test_schemathesis_finds_nothing_on_the_default_server(aiohttp_client, tmp_path):
    """The plain default server (its simulated step made instant, nothing else changed)."""
    await _schemathesis(aiohttp_client, tmp_path, Engine(Config(sim_step_ms=(0.0, 0.0))))
