"""Several models and versions in one engine: the models file, routing, params, and the
invariant that a batch call never mixes compatibility keys."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchserve.batching.request import Ask
from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Caller
from batchserve.errors import InvalidInput, ModelNotFound, StartupError
from batchserve.models.registry import Registry, Routes, VersionState, Wording
from batchserve.models.specs import ModelSpec, load_models_file
from batchserve.server import create_app

from . import sample_models
from .conftest import ROOT, GatedBackend, reach, real_server

TWO_MODELS = """
[[model]]
name = "a"
version = "1"
fn = "tests.sample_models:key_echo_a1"
devices = "sim:3"
weight = 3

[[model]]
name = "a"
version = "2"
fn = "tests.sample_models:key_echo_a2"
devices = "sim:2"
weight = 1

[[model]]
name = "b"
version = "1"
fn = "tests.sample_models:key_echo_b1"
devices = "sim:3"
max_batch_size = 7
"""


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(TWO_MODELS)
    return path


def specs() -> list[ModelSpec]:
    return [
        ModelSpec(name="a", version="1", fn=sample_models.key_echo_a1, devices="sim:3", weight=3),
        ModelSpec(name="a", version="2", fn=sample_models.key_echo_a2, devices="sim:2", weight=1),
        ModelSpec(name="b", version="1", fn=sample_models.key_echo_b1, devices="sim:3"),
    ]


def test_a_models_file_reads_every_entry_with_the_flags_as_defaults(models_file):
    a1, a2, b1 = load_models_file(str(models_file), Config(max_batch_size=50))
    assert (a1.label, a1.devices, a1.weight, a1.max_batch_size) == ("a@1", "sim:3", 3, 50)
    assert (a2.label, a2.fn) == ("a@2", "tests.sample_models:key_echo_a2")
    assert (b1.max_batch_size, b1.weight, b1.cost) == (7, None, "flat")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('name = "a"', "entry 1 (a@?): field 'version' is required"),
        ('name = "a"\nversion = 1', "entry 1 (a@1): field 'version' must be a str, not int"),
        ('name = "a"\nversion = "1"\nweight = 0', "(a@1): field 'weight' must be more than 0"),
        ('name = "a"\nversion = "1"\ncolour = "red"', "(a@1): unknown field 'colour'"),
        ('name = "a b"\nversion = "1"', "field 'name' must be 1 to 64 letters"),
        ('name = "a"\nversion = "1"\ncost = "cubic"', "field 'cost' must be \"flat\" or"),
        ('name = "a"\nversion = "1"\nmax_batch_size = 101', "'max_batch_size' must be between"),
        ('name = "a"\nversion = "1"\nmax_batch_tokens = 64', "'max_batch_tokens' needs cost"),
        ('name = "a"\nversion = "1"\nfn = "x:y"\nfn_per_device = "x:z"', "fn or fn_per_device"),
    ],
)
def test_a_bad_entry_fails_start_up_with_one_line_naming_it_and_the_field(tmp_path, entry, message):
    path = tmp_path / "models.toml"
    path.write_text(f"[[model]]\n{entry}\n")
    with pytest.raises(StartupError) as caught:
        load_models_file(str(path), Config())
    assert message in str(caught.value)
    assert str(caught.value).startswith(f"--models {path}: [[model]] entry 1")
    assert "\n" not in str(caught.value)


def test_a_repeated_version_an_empty_file_and_bad_toml_are_refused(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[[model]]\nname = "a"\nversion = "1"\n' * 2)
    with pytest.raises(StartupError, match=r"entry 2 \(a@1\): field 'version' repeats a@1"):
        load_models_file(str(path), Config())
    path.write_text("")
    with pytest.raises(StartupError, match=r"one or more \[\[model\]\] tables"):
        load_models_file(str(path), Config())
    path.write_text("[[model]\n")
    with pytest.raises(StartupError, match="not valid TOML"):
        load_models_file(str(path), Config())
    with pytest.raises(StartupError, match="cannot read it"):
        load_models_file(str(tmp_path / "missing.toml"), Config())


async def test_requests_route_by_model_and_version_and_answers_name_them():
    async with Engine(Config(sim_latency_ms=0), models=specs()) as engine:
        pinned = await engine.infer(Ask("x", model="a", version="2"))
        assert (pinned.output, pinned.model, pinned.version) == ("a@2||x", "a", "2")
        assert (await engine.infer(Ask("y", model="b"))).output == "b@1||y"
        with pytest.raises(InvalidInput, match='name a "model": this server runs a, b'):
            await engine.infer("z")
        with pytest.raises(ModelNotFound, match="no model 'c'; this server runs a, b"):
            await engine.infer(Ask("z", model="c"))
        with pytest.raises(ModelNotFound, match="model a has no version '9'; it has 1, 2"):
            await engine.infer(Ask("z", model="a", version="9"))
        with pytest.raises(InvalidInput, match='name a "model"'):
            await engine.infer(Ask("z", version="1"))  # a version alone needs one model name


@dataclasses.dataclass
class _Routed:
    """A version as routing sees it (`Routable`): a batch one or a generation one."""

    spec: ModelSpec
    state: VersionState = VersionState.READY

    def describe(self) -> dict[str, Any]:
        return {"version": self.spec.version}


def test_one_routing_table_serves_batch_and_generation_models_alike():
    # Routes is the one router: Registry and Generators differ only in their wording.
    a1, a2 = _Routed(ModelSpec(name="a", version="1")), _Routed(ModelSpec(name="a", version="2"))
    gone = _Routed(ModelSpec(name="a", version="3"), VersionState.DRAINING)
    routes = Routes([a1, a2, gone], Wording("generation model", "generates with", "no model"))
    assert routes.route(None, "2", "id") is a2
    assert {routes.route("a", None, f"id-{n}").spec.version for n in range(50)} == {"1", "2"}
    assert routes.route("a", None, "same") is routes.route(None, None, "same")
    with pytest.raises(ModelNotFound, match="model a has no version '3'; it has 1, 2"):
        routes.route("a", "3", "id")
    with pytest.raises(ModelNotFound, match="no generation model 'b'; this server generates"):
        routes.route("b", None, "id")
    with pytest.raises(InvalidInput, match="this server runs no batch model"):
        Registry([]).route(None, None, "id")


async def test_unpinned_requests_share_a_name_by_weight_and_the_same_id_lands_the_same():
    async with Engine(Config(sim_latency_ms=0), models=specs()) as engine:
        ids = [f"request-{n}" for n in range(400)]
        first = await asyncio.gather(
            *(engine.infer(Ask("x", model="a"), Caller(request_id=i)) for i in ids)
        )
        again = await asyncio.gather(
            *(engine.infer(Ask("x", model="a"), Caller(request_id=i)) for i in ids)
        )
    assert [r.version for r in first] == [r.version for r in again]
    shares = Counter(r.version for r in first)
    assert 0.65 < shares["1"] / len(ids) < 0.85  # weight 3 of 4; crc32 of fixed ids
    assert all(r.output == f"a@{r.version}||x" for r in first)


async def test_params_reach_a_function_that_takes_them_and_are_refused_by_one_that_does_not():
    models = [
        ModelSpec(name="scaled", version="1", fn=sample_models.scaled, devices="sim:1"),
        ModelSpec(name="shout", version="1", fn=sample_models.shout, devices="sim:1"),
    ]
    async with Engine(Config(sim_latency_ms=0), models=models) as engine:
        assert (
            await engine.infer(Ask("ab", model="scaled", params={"factor": 3}))
        ).output == "ababab"
        assert (await engine.infer(Ask("ab", model="scaled", params={}))).output == "ab"
        assert (
            await engine.infer(Ask("ab", model="shout", params={}))
        ).output == "AB"  # {} is none
        with pytest.raises(InvalidInput, match="takes no param 'size'; it takes factor"):
            await engine.infer(Ask("ab", model="scaled", params={"size": 3}))
        with pytest.raises(InvalidInput, match="model shout@1 takes no params"):
            await engine.infer(Ask("ab", model="shout", params={"factor": 3}))


async def test_requests_with_different_params_never_share_a_call(gated: GatedBackend):
    def echo_params(device: str):
        run = gated(device)

        def with_params(inputs: list[str], **params: Any) -> list[str]:
            return [f"{text}{params}" for text in run(inputs)]

        return with_params

    model = ModelSpec(name="m", version="1", fn_per_device=echo_params, devices="sim:1")
    async with Engine(Config(), models=[model]) as engine:
        first = engine.submit("first")
        await gated.entered("sim:0")  # holds the one device; the rest queue behind it
        waiting = [engine.submit(Ask(f"in{i}", params={"n": i % 3})) for i in range(9)]
        gated.gate.set()
        results = [await ticket for ticket in waiting]
        await first
    calls = sorted(inputs for _, inputs in gated.calls[1:])
    assert calls == [[f"in{i}" for i in range(n, 9, 3)] for n in (0, 1, 2)]
    assert [r.output for r in results] == [f"{i}ni{ {'n': i % 3} }" for i in range(9)]


async def test_a_cold_model_does_not_wait_behind_a_hot_models_backlog(gated: GatedBackend):
    hot = ModelSpec(name="hot", version="1", fn_per_device=gated, devices="sim:1")
    cold = ModelSpec(name="cold", version="1", fn_per_device=gated, devices="sim:1")
    async with Engine(Config(), models=[hot, cold]) as engine:
        first = engine.submit(Ask("first", model="hot"))
        await gated.entered("sim:0")  # the shared device is busy; a backlog builds behind it
        backlog = [engine.submit(Ask(f"h{n}", model="hot")) for n in range(250)]
        late = engine.submit(Ask("late", model="cold"))
        gated.gate.set()
        await asyncio.gather(first, late, *backlog)
    sizes = [len(inputs) for _, inputs in gated.calls]
    assert sizes == [1, 100, 1, 100, 50]  # the cold request went second, not last
    assert gated.calls[2][1] == ["late"]


async def test_a_model_with_few_requests_spaces_its_batches_over_its_share_of_devices(
    gated: GatedBackend,
):
    """Three shared devices, 100 ms calls. The cold model has 1 % of the arrivals: its
    partial batches are spaced as if it had one device (90 ms from its last start), not
    three (30 ms), so its small batches do not take the devices the hot model's need."""
    clock = FakeClock()
    models = [
        ModelSpec(name=name, version="1", fn_per_device=gated, devices="sim:3",
                  max_linger_ms=1000)
        for name in ("hot", "cold")
    ]  # fmt: skip
    async with Engine(Config(), models=models, clock=clock) as engine:
        measure = [engine.submit(Ask("h", model="hot")), engine.submit(Ask("c", model="cold"))]
        await reach(engine, lambda s: s.in_flight == 2)
        clock.advance(0.100)
        gated.gate.set()
        await asyncio.gather(*measure)
        gated.gate.clear()
        hot = [engine.submit(Ask(f"h{n}", model="hot")) for n in range(100)]  # a full batch
        first = engine.submit(Ask("c1", model="cold"))
        await reach(engine, lambda s: s.in_flight == 101 and s.free_devices == 1)
        held = engine.submit(Ask("c2", model="cold"))
        await reach(engine, lambda s: s.queued == 1)
        clock.advance(0.089)  # one device free: alone, cold would have sent at 30 ms
        await asyncio.sleep(0)
        assert engine.stats().queued == 1
        clock.advance(0.002)
        await reach(engine, lambda s: s.queued == 0 and s.in_flight == 102)
        gated.gate.set()
        await asyncio.gather(first, held, *hot)
    cold_calls = sorted(inputs for _, inputs in gated.calls if inputs[0][0] == "c")
    assert cold_calls == [["c"], ["c1"], ["c2"]]


async def test_get_api_models_lists_models_versions_devices_weights_and_state(
    aiohttp_client, models_file
):
    engine = Engine(Config(models=str(models_file), sim_latency_ms=0))
    client = await aiohttp_client(create_app(engine))
    listing = await (await client.get("/api/models")).json()
    assert listing == {
        "models": [
            {
                "name": "a",
                "versions": [
                    {
                        "version": "1",
                        "state": "ready",
                        "kind": "batch",
                        "weight": 3,
                        "devices": ["sim:0", "sim:1", "sim:2"],
                        "cost": "flat",
                        "max_batch_size": 100,
                    },
                    {
                        "version": "2",
                        "state": "ready",
                        "kind": "batch",
                        "weight": 1,
                        "devices": ["sim:0", "sim:1"],
                        "cost": "flat",
                        "max_batch_size": 100,
                    },
                ],
            },
            {
                "name": "b",
                "versions": [
                    {
                        "version": "1",
                        "state": "ready",
                        "kind": "batch",
                        "weight": None,
                        "devices": ["sim:0", "sim:1", "sim:2"],
                        "cost": "flat",
                        "max_batch_size": 7,
                    }
                ],
            },
        ]
    }


async def test_http_requests_name_model_version_and_params_and_get_4xx_for_bad_ones(
    aiohttp_client, models_file
):
    engine = Engine(Config(models=str(models_file), sim_latency_ms=0))
    client = await aiohttp_client(create_app(engine))
    answer = await client.post("/api/inference", json={"input": "x", "model": "a", "version": "2"})
    body = await answer.json()
    assert (answer.status, body["output"], body["model"], body["version"]) == (
        200, "a@2||x", "a", "2",
    )  # fmt: skip
    with_params = await client.post(
        "/api/inference", json={"input": "x", "model": "b", "params": {"t": [1, {"z": 1, "a": 2}]}}
    )
    assert (await with_params.json())["output"] == 'b@1|{"t":[1,{"a":2,"z":1}]}|x'
    for body, status, code in [
        ({"input": "x"}, 400, "INVALID_INPUT"),
        ({"input": "x", "model": "nope"}, 404, "MODEL_NOT_FOUND"),
        ({"input": "x", "model": "a", "version": "7"}, 404, "MODEL_NOT_FOUND"),
        ({"input": "x", "model": 3}, 400, "INVALID_INPUT"),
        ({"input": "x", "model": "a", "params": [1]}, 400, "INVALID_INPUT"),
    ]:
        refused = await client.post("/api/inference", json=body)
        assert (refused.status, (await refused.json())["error"]) == (status, code), body
    submitted = await client.post(
        "/api/requests", json={"input": "y", "model": "a", "version": "1"}
    )
    assert submitted.status == 202
    await reach(engine, lambda s: s.pending == 0)
    polled = await client.get(f"/api/requests/{(await submitted.json())['request_id']}")
    body = await polled.json()
    assert (body["status"], body["output"], body["version"]) == ("completed", "a@1||y", "1")


async def test_outputs_may_be_any_json_value(aiohttp_client):
    engine = Engine(Config(fn="tests.sample_models:vectors", sim_latency_ms=0))
    client = await aiohttp_client(create_app(engine))
    body = await (await client.post("/api/inference", json={"input": "abc"})).json()
    assert body["output"] == [3.0, 1.0]


REQUESTS = st.lists(
    st.tuples(
        st.sampled_from([("a", None), ("a", "1"), ("a", "2"), ("b", None), ("b", "1")]),
        st.sampled_from([None, {}, {"x": 1}, {"x": 2}, {"y": [1, 2]}, {"x": 1, "y": "z"}]),
        st.integers(min_value=0, max_value=3),
    ),
    min_size=1,
    max_size=120,
)


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(requests=REQUESTS, seed=st.integers(0, 2**16))
def test_a_batch_call_never_mixes_models_versions_or_params(requests, seed):
    """Random keys, random arrival order and interleaving, devices shared between models:
    every answer comes from a call of the request's own version and its own params."""

    async def run() -> None:
        order = random.Random(seed)

        async def one(n: int, model: str, version: str | None, params: Any, yields: int):
            for _ in range(yields):
                await asyncio.sleep(0)  # arrivals interleave with the batcher's passes
            result = await engine.infer(Ask(f"r{n}", model=model, version=version, params=params))
            shown = orjson.dumps(params, option=orjson.OPT_SORT_KEYS).decode() if params else ""
            assert result.output == f"{model}@{result.version}|{shown}|r{n}"
            assert version in (None, result.version)
            return result

        async with Engine(Config(sim_latency_ms=0), models=specs()) as engine:
            calls = [one(n, m, v, p, y) for n, ((m, v), p, y) in enumerate(requests)]
            order.shuffle(calls)
            results = await asyncio.gather(*calls)
        assert len(results) == len(requests)

    asyncio.run(run())


async def test_the_cli_serves_a_models_file(models_file):
    async with real_server("--models", str(models_file)) as server:
        assert "models=a@1,a@2,b@1" in server.banner
        async with aiohttp.ClientSession() as session:
            answer = await session.post(
                f"{server.url}/api/inference", json={"input": "x", "model": "b"}
            )
            assert (await answer.json())["output"] == "b@1||x"


def test_the_cli_refuses_a_bad_models_file_with_one_line(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[[model]]\nname = "a"\nversion = "1"\ndevices = "sim:x"\n')
    result = subprocess.run(
        [sys.executable, "-m", "batchserve", "--models", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "model a@1: --devices 'sim:x': expected sim:N" in result.stderr


async def test_metrics_label_models_but_never_client_text(aiohttp_client, models_file):
    engine = Engine(Config(models=str(models_file), sim_latency_ms=0))
    client = await aiohttp_client(create_app(engine))
    for body in [
        {"input": "x", "model": "b"},
        {"input": "x", "model": "b", "params": {"secret-param": 1}},
        {"input": "x", "model": "made-up-model"},
    ]:
        await client.post("/api/inference", json=body)
    metrics = await (await client.get("/metrics")).text()
    assert 'batchserve_batch_fill_total{kind="requests",model="b",version="1"} 2.0' in metrics
    assert 'batchserve_request_latency_seconds_count{model="b",version="1"} 2.0' in metrics
    assert "made-up-model" not in metrics
    assert "secret-param" not in metrics
    stats = await (await client.get("/api/stats")).json()  # the dashboard's numbers
    rows = {row["label"]: row for row in stats["models"]}
    assert sorted(rows) == ["a@1", "a@2", "b@1"]
    assert rows["b@1"]["throughput_rps"] == 2 / 2.0  # answers in the last two seconds
    assert rows["b@1"]["batches"] >= 1
    assert rows["b@1"]["arrival_rps"] > 0
    assert rows["a@1"]["throughput_rps"] == 0
    assert rows["a@1"]["p99_ms"] is None
    assert rows["a@1"]["devices"] == ["sim:0", "sim:1", "sim:2"]
    assert {row["state"] for row in rows.values()} == {"ready"}
    assert "made-up-model" not in str(stats)
