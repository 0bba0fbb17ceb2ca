"""KServe's Open Inference Protocol (v2), driven by the real `tritonclient[http]` against a
live server on 127.0.0.1: health, metadata, readiness per version, inference of BYTES
tensors (binary and JSON), a version pin, bad input, and batching with other traffic.

tritonclient's sync client runs on gevent: each call here runs in a thread of its own, with a
client of its own, while the server runs on the test's loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import tritonclient.http as triton
from aiohttp.test_utils import TestClient
from tritonclient.utils import InferenceServerException

from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import MAX_INPUTS_PER_CALL
from batchserve.models.backends import simulate
from batchserve.models.specs import ModelSpec
from batchserve.server import create_app

from . import sample_models
from .conftest import TWO_TENANT_KEYS, BatchserveTestServer, GatedBackend, reach

T = TypeVar("T")
Served = tuple[TestClient, Engine, str]


@pytest.fixture
async def served(aiohttp_client, gated: GatedBackend) -> AsyncIterator[Served]:
    """Model "echo" (the gated backend: each input reversed) and model "ab" in two versions
    whose outputs name the version that made them."""
    engine = Engine(
        Config(),
        models=[
            ModelSpec(name="echo", version="1", fn_per_device=gated, devices="sim:1"),
            ModelSpec(name="ab", version="1", fn=sample_models.key_echo_a1, devices="sim:1"),
            ModelSpec(name="ab", version="2", fn=sample_models.key_echo_a2, devices="sim:1"),
            ModelSpec(name="vec", version="1", fn=sample_models.vectors, devices="sim:1"),
        ],
    )
    client = await aiohttp_client(BatchserveTestServer(create_app(engine)))
    yield client, engine, f"127.0.0.1:{client.port}"
    sample_models.LOAD_GATE.set()  # a version left loading must not hang the shutdown


async def with_triton(url: str, call: Callable[[triton.InferenceServerClient], T]) -> T:
    def run() -> T:
        client = triton.InferenceServerClient(url)
        try:
            return call(client)
        finally:
            client.close()

    return await asyncio.to_thread(run)


def strings(texts: list[str], *, binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput("input", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object), binary)
    return tensor


def decoded(result: triton.InferResult) -> list[str]:
    """The output's strings: bytes from a binary answer, str from a JSON one."""
    return [i.decode() if isinstance(i, bytes) else i for i in result.as_numpy("output")]


def refusal(call: Callable[[triton.InferenceServerClient], Any]) -> Callable[..., Any]:
    """`call`, turned into the InferenceServerException it raises (it must raise)."""

    def run(client: triton.InferenceServerClient) -> InferenceServerException:
        with pytest.raises(InferenceServerException) as raised:
            call(client)
        return raised.value

    return run


async def test_health_metadata_and_readiness_per_version(served: Served) -> None:
    client, engine, url = served
    sample_models.LOAD_GATE.clear()
    loading = ModelSpec(name="ab", version="3", fn_per_device=sample_models.slow_to_load,
                        devices="sim:1")  # fmt: skip
    assert engine.versions.add(loading, engine.config)["state"] == "loading"

    def probe(c: triton.InferenceServerClient) -> dict[str, Any]:
        return {
            "live": c.is_server_live(),
            "ready": c.is_server_ready(),
            "server": c.get_server_metadata(),
            "ab": c.get_model_metadata("ab"),
            "ab@2": c.get_model_metadata("ab", "2"),
            "ready ab": c.is_model_ready("ab"),
            "ready ab@1": c.is_model_ready("ab", "1"),
            "ready ab@3 (loading)": c.is_model_ready("ab", "3"),
            "ready ab@9 (unknown)": c.is_model_ready("ab", "9"),
            "ready nope": c.is_model_ready("nope"),
        }

    seen = await with_triton(url, probe)
    assert seen["live"]
    assert seen["ready"]
    assert seen["server"]["name"] == "batchserve"
    assert "binary_tensor_data" in seen["server"]["extensions"]
    tensor = {"datatype": "BYTES", "shape": [-1]}
    assert seen["ab"] == {
        "name": "ab", "versions": ["1", "2", "3"], "platform": "batchserve",
        "inputs": [{"name": "input", **tensor}], "outputs": [{"name": "output", **tensor}],
    }  # fmt: skip
    assert seen["ab@2"]["versions"] == ["2"]
    assert seen["ready ab"]
    assert seen["ready ab@1"]
    assert not seen["ready ab@3 (loading)"]
    assert not seen["ready ab@9 (unknown)"]
    assert not seen["ready nope"]
    # Not ready is the protocol's 4xx: 400 for a version loading, 404 for none such.
    loading_ready = await client.get("/v2/models/ab/versions/3/ready")
    assert loading_ready.status == 400
    assert "not ready (3 loading)" in (await loading_ready.json())["error"]
    unknown_ready = await client.get("/v2/models/ab/versions/9/ready")
    assert unknown_ready.status == 404
    assert "has no version '9'" in (await unknown_ready.json())["error"]
    unknown = await with_triton(url, refusal(lambda c: c.get_model_metadata("nope")))
    assert (unknown.status(), "no model 'nope'" in unknown.message()) == ("404", True)
    sample_models.LOAD_GATE.set()
    await engine.versions.settled()
    assert await with_triton(url, lambda c: c.is_model_ready("ab", "3"))
    await engine.drain()
    assert not await with_triton(url, lambda c: c.is_server_ready() or c.is_model_ready("ab"))
    draining = await client.get("/v2/health/ready")
    assert (draining.status, await draining.json()) == (
        400, {"error": "the server is not ready: draining"},
    )  # fmt: skip


async def test_64_strings_batch_with_other_traffic_each_answered_with_its_own(
    served: Served, gated: GatedBackend
) -> None:
    client, engine, url = served
    holding = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "hold", "model": "echo"})
    )
    await reach(engine, lambda s: s.in_flight == 1)
    texts = [f"string {n}" for n in range(64)]
    inferred = asyncio.ensure_future(
        with_triton(url, lambda c: c.infer("echo", [strings(texts)], request_id="call-7"))
    )
    await reach(engine, lambda s: s.queued == 64)
    other = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "other", "model": "echo"})
    )
    await reach(engine, lambda s: s.queued == 65)
    gated.gate.set()
    result = await inferred
    assert decoded(result) == [simulate(text) for text in texts]
    response = result.get_response()
    assert (response["id"], response["model_name"], response["model_version"]) == (
        "call-7", "echo", "1",
    )  # fmt: skip
    assert (await (await other).json())["output"] == simulate("other")
    assert (await holding).status == 200
    # The tensor's strings rode in one batch call with the other request.
    (shared,) = [inputs for _, inputs in gated.calls if "other" in inputs]
    assert set(texts) <= set(shared)
    one = await with_triton(url, lambda c: c.infer("echo", [strings(["solo"])]))
    assert decoded(one) == ["olos"]


async def test_a_version_pin_json_data_requested_outputs_and_nested_shape(served: Served) -> None:
    client, _, url = served

    def pinned(c: triton.InferenceServerClient) -> triton.InferResult:
        wanted = triton.InferRequestedOutput("output", binary_data=False)
        tensor = strings(["x", "y"], binary=False)
        return c.infer("ab", [tensor], model_version="2", outputs=[wanted])

    result = await with_triton(url, pinned)
    assert decoded(result) == ["a@2||x", "a@2||y"]
    output = result.get_output("output")
    assert output["data"] == ["a@2||x", "a@2||y"]  # JSON, as asked: no binary part
    assert result.get_response()["model_version"] == "2"
    tensor = {"name": "input", "shape": [2, 1], "datatype": "BYTES", "data": [["p"], ["q"]]}
    nested = await client.post(
        "/v2/models/ab/versions/1/infer",
        json={"inputs": [tensor]},
        headers={"X-Request-Id": "mine"},
    )
    assert nested.headers["X-Request-Id"] == "mine"
    body = await nested.json()
    assert body["outputs"] == [
        {"name": "output", "datatype": "BYTES", "shape": [2, 1], "data": ["a@1||p", "a@1||q"]}
    ]
    assert "id" not in body  # none given, none echoed
    vectors = await with_triton(url, lambda c: c.infer("vec", [strings(["abc"])]))
    assert decoded(vectors) == ["[3.0,1.0]"]  # an output that is not a string: its JSON


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        ({"name": "input", "shape": [1], "datatype": "INT32", "data": [1]}, 'datatype "BYTES"'),
        ({"name": "input", "shape": [1], "datatype": "BYTES", "data": [1]}, "list of strings"),
        ({"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}, 'named "input"'),
        ({"name": "input", "shape": [2], "datatype": "BYTES", "data": ["a"]}, "1 strings for"),
        ({"name": "input", "shape": [1, 2], "datatype": "BYTES", "data": ["a", "b"]}, "[N, 1]"),
        ({"name": "input", "shape": [], "datatype": "BYTES", "data": []}, "shape [N]"),
        (
            {"name": "input", "shape": [MAX_INPUTS_PER_CALL + 1], "datatype": "BYTES",
             "data": ["a"] * (MAX_INPUTS_PER_CALL + 1)},
            f"holds {MAX_INPUTS_PER_CALL + 1} strings; the limit is {MAX_INPUTS_PER_CALL}",
        ),
    ],
)  # fmt: skip
async def test_bad_tensors_get_400_in_the_protocols_error_shape(
    served: Served, tensor: dict[str, Any], message: str
) -> None:
    client, _, _ = served
    answer = await client.post("/v2/models/ab/infer", json={"inputs": [tensor]})
    body = await answer.json()
    assert (answer.status, body["code"]) == (400, "INVALID_INPUT"), body
    assert message in body["error"]
    assert body["request_id"] == answer.headers["X-Request-Id"]


async def test_tritonclient_sees_bad_input_unknown_models_and_broken_binary_bodies(
    served: Served,
) -> None:
    client, _, url = served

    def wrong_type(c: triton.InferenceServerClient) -> None:
        numbers = triton.InferInput("input", [2], "INT32")
        numbers.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
        c.infer("ab", [numbers])

    bad = await with_triton(url, refusal(wrong_type))
    assert (bad.status(), 'must have datatype "BYTES"' in bad.message()) == ("400", True)
    missing = await with_triton(url, refusal(lambda c: c.infer("ab", [])))
    assert (missing.status(), 'must hold one tensor, "input"' in missing.message()) == (
        "400", True,
    )  # fmt: skip
    nope = await with_triton(url, refusal(lambda c: c.infer("nope", [strings(["a"])])))
    assert (nope.status(), "no model 'nope'" in nope.message()) == ("404", True)
    no_version = await with_triton(
        url, refusal(lambda c: c.infer("ab", [strings(["a"])], model_version="9"))
    )
    assert (no_version.status(), "has no version '9'" in no_version.message()) == ("404", True)
    header = b'{"inputs":[{"name":"input","shape":[1],"datatype":"BYTES",' \
             b'"parameters":{"binary_data_size":9}}]}'  # fmt: skip
    for tail, problem in (
        (b"\x05\x00\x00\x00ab", "must be a length within the body"),
        (b"\x05\x00\x00\x00abcde!", "past its tensors' data"),
        (b"\x05\x00\x00\x00ab\xffde", "not UTF-8"),
    ):
        sent = await client.post(
            "/v2/models/ab/infer",
            data=header + tail,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
        assert (sent.status, problem in (await sent.json())["error"]) == (400, True), tail
    for length in ("\u00b2", "0" * 5000, "-1"):  # digits int() refuses, or no length
        sent = await client.post(
            "/v2/models/ab/infer", data=header, headers={"Inference-Header-Content-Length": length}
        )
        assert sent.status == 400, length
        assert "must be a length within the body" in (await sent.json())["error"]


async def test_api_keys_apply(aiohttp_client, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(TWO_TENANT_KEYS)
    engine = Engine(Config(keys_file=str(keys)), fn=sample_models.shout, devices="sim:1")
    client = await aiohttp_client(BatchserveTestServer(create_app(engine)))
    url = f"127.0.0.1:{client.port}"
    refused = await with_triton(url, refusal(lambda c: c.infer("default", [strings(["a"])])))
    assert (refused.status(), "Authorization" in refused.message()) == ("401", True)
    alice = {"Authorization": "Bearer sk-alice"}
    shouted = await with_triton(url, lambda c: c.infer("default", [strings(["a"])], headers=alice))
    assert decoded(shouted) == ["A"]
    assert await with_triton(url, lambda c: c.is_server_ready())  # probes need no key
    metadata = await client.get("/v2/models/default")
    assert metadata.status == 401


async def test_the_deadline_applies_as_tritonclients_timeout(
    served: Served, gated: GatedBackend
) -> None:
    """The device never answers while the gate is shut, so the request can only end by its
    deadline (1 ms, in microseconds as tritonclient's `timeout` counts)."""
    _, _, url = served
    late = await with_triton(
        url, refusal(lambda c: c.infer("echo", [strings(["slow"])], timeout=1000))
    )
    gated.gate.set()
    assert late.status() == "504"
