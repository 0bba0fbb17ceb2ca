"""The admin API: versions loaded, reweighted and removed while the server serves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient

from batchserve.batching.request import Ask
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.server import create_app

from . import raw_http, sample_models
from .conftest import HANG_GUARD_S

KEY = "admin-s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTE = "/admin/models/a/versions/2"
A2 = {"fn": "tests.sample_models:key_echo_a2", "devices": "sim:2", "weight": 1}


@pytest.fixture
async def served(aiohttp_client, tmp_path) -> AsyncIterator[tuple[TestClient, Engine]]:
    models = tmp_path / "models.toml"
    models.write_text(
        '[[model]]\nname = "a"\nversion = "1"\nfn = "tests.sample_models:key_echo_a1"\n'
        'devices = "sim:2"\n'
    )
    # Every /metrics scrape renders all (no reuse): these tests read series just deleted.
    config = Config(models=str(models), admin_key=KEY, sim_latency_ms=0, metrics_max_age_ms=0)
    engine = Engine(config)
    yield await aiohttp_client(create_app(engine)), engine
    sample_models.LOAD_GATE.set()


async def versions(client: TestClient) -> dict[str, dict[str, object]]:
    listing = await (await client.get("/api/models")).json()
    return {v["version"]: v for model in listing["models"] for v in model["versions"]}


async def test_without_an_admin_key_the_admin_routes_are_not_there(aiohttp_client):
    client = await aiohttp_client(create_app(Engine(Config(sim_latency_ms=0))))
    answer = await client.put("/admin/models/default/versions/2", json=A2, headers=AUTH)
    assert (answer.status, (await answer.json())["error"]) == (404, "NOT_FOUND")


async def test_a_missing_or_wrong_key_is_401_and_changes_nothing(served):
    client, _ = served
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"}):
        for method in ("PUT", "PATCH", "DELETE"):
            answer = await client.request(method, ROUTE, json=A2, headers=headers)
            assert answer.status == 401, (method, headers)
            assert answer.headers["WWW-Authenticate"] == "Bearer"
    assert list(await versions(client)) == ["1"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"weight": -1}, "field 'weight' must be more than 0"),
        ({"colour": "red"}, "unknown field 'colour'"),
        ({"version": "3"}, "field 'version' differs from the path's '2'"),
        ({"devices": "sim:9"}, "sim:4, sim:5, sim:6, sim:7, sim:8 is not a device"),
        ({"fn": "tests.sample_models:nope"}, "has no attribute nope"),
        ({"max_batch_size": "big"}, "field 'max_batch_size' must be a int, not str"),
        (
            {"generator": "sim", "devices": "sim:2"},
            "field 'generator': a generation model cannot be added",
        ),
    ],
)
async def test_a_bad_put_is_400_naming_the_field_and_changes_nothing(served, body, message):
    client, _ = served
    answer = await client.put(ROUTE, json=body, headers=AUTH)
    assert answer.status == 400
    assert message in (await answer.json())["message"]
    assert list(await versions(client)) == ["1"]


async def test_a_put_without_devices_loads_on_the_servers_devices(served):
    """The server runs from --models on sim:2, --devices left at its sim:4: a body that
    names no devices takes the server's own, not the flag's (Schemathesis' PUT {})."""
    client, engine = served
    added = await client.put(ROUTE, json={"fn": A2["fn"]}, headers=AUTH)
    assert added.status == 202, await added.text()
    assert (await added.json())["devices"] == ["sim:0", "sim:1"]
    await engine.versions.settled()
    empty = await client.put("/admin/models/a/versions/3", json={}, headers=AUTH)
    assert empty.status == 202, await empty.text()


async def test_a_version_loads_in_the_background_then_takes_its_share(served):
    client, engine = served
    sample_models.LOAD_GATE.clear()
    slow = {"fn_per_device": "tests.sample_models:slow_to_load", "devices": "sim:2"}
    added = await client.put(ROUTE, json=slow, headers=AUTH)
    assert added.status == 202
    assert (await added.json())["state"] == "loading"
    assert (await versions(client))["2"]["state"] == "loading"
    pinned = await client.post("/api/inference", json={"input": "x", "model": "a", "version": "2"})
    assert (pinned.status, (await pinned.json())["error"]) == (503, "NOT_READY")
    assert pinned.headers["Retry-After"] == "1"
    unpinned = await client.post("/api/inference", json={"input": "x", "model": "a"})
    assert (await unpinned.json())["version"] == "1"  # a loading version takes no traffic
    again = await client.put(ROUTE, json=slow, headers=AUTH)
    assert (again.status, (await again.json())["error"]) == (409, "CONFLICT")
    sample_models.LOAD_GATE.set()
    await engine.versions.settled()
    assert (await versions(client))["2"]["state"] == "ready"
    answer = await client.post("/api/inference", json={"input": "x", "model": "a", "version": "2"})
    assert (await answer.json())["output"] == "a@2||x"
    reweighted = await client.patch(ROUTE, json={"weight": 9}, headers=AUTH)
    assert (reweighted.status, (await reweighted.json())["weight"]) == (200, 9)
    shares = [
        (await (await client.post(
            "/api/inference", json={"input": "x", "model": "a"}, headers={"X-Request-Id": f"r{n}"}
        )).json())["version"]
        for n in range(100)
    ]  # fmt: skip
    assert 75 < shares.count("2") < 100  # weight 9 against 1 (crc32 of fixed ids)
    bad_patch = await client.patch(ROUTE, json={"weight": 0}, headers=AUTH)
    assert bad_patch.status == 400


async def test_delete_finishes_what_is_queued_then_unloads(served):
    client, engine = served
    assert (await client.put(ROUTE, json=A2, headers=AUTH)).status == 202
    await engine.versions.settled()
    queued = [
        asyncio.ensure_future(engine.infer(Ask(f"q{n}", model="a", version="2"))) for n in range(50)
    ]
    await asyncio.sleep(0)  # they are queued before the delete
    removed = await client.delete(ROUTE, headers=AUTH)
    assert (removed.status, (await removed.json())["state"]) == (202, "draining")
    pinned = await client.post("/api/inference", json={"input": "x", "model": "a", "version": "2"})
    assert (pinned.status, (await pinned.json())["error"]) == (404, "MODEL_NOT_FOUND")
    assert [r.output for r in await asyncio.gather(*queued)] == [f"a@2||q{n}" for n in range(50)]
    await engine.versions.settled()
    assert list(await versions(client)) == ["1"]
    gone = await client.delete(ROUTE, headers=AUTH)
    assert (gone.status, (await gone.json())["error"]) == (404, "MODEL_NOT_FOUND")
    assert (await client.put(ROUTE, json=A2, headers=AUTH)).status == 202  # it can come back


async def test_deleted_versions_leave_no_metric_series(served):
    """Versions added, answered and deleted, each under a new name: the scrape keeps the same
    number of series, and none names a deleted version."""
    client, engine = served

    async def cycle(version: str) -> None:
        route = f"/admin/models/a/versions/{version}"
        assert (await client.put(route, json=A2, headers=AUTH)).status == 202
        await engine.versions.settled()
        answer = await client.post(
            "/api/inference", json={"input": "x", "model": "a", "version": version}
        )
        assert (await answer.json())["output"] == "a@2||x"
        assert (await client.delete(route, headers=AUTH)).status == 202
        await engine.versions.settled()

    async def series() -> list[str]:
        scrape = await (await client.get("/metrics")).text()
        return [line.rsplit(" ", 1)[0] for line in scrape.splitlines() if line[:1] != "#"]

    await cycle("v0")  # the families the first cycle brings (batch sizes, busy time...)
    before = await series()
    for n in range(1, 6):
        await cycle(f"v{n}")
    after = await series()
    assert len(after) == len(before)
    assert not [line for line in after if 'version="v' in line]
    assert len(after) == len(set(after))  # no series twice (Prometheus refuses that scrape)


async def test_a_version_deleted_with_a_request_in_flight_leaves_no_metric_series(served):
    """The unload waits for the batch inside the device and forgets the version's series
    as soon as that batch is done, before its handler records the answer (the batcher wakes
    its watchers ahead of the request futures); the recording must then drop the answer of
    a version no longer registered rather than bring its series back, one set per version
    deleted while it served."""
    client, engine = served
    sample_models.HOLD_ENTERED.clear()
    sample_models.HOLD_RELEASE.clear()
    held = {"fn_per_device": "tests.sample_models:held_a2", "devices": "sim:2"}
    assert (await client.put(ROUTE, json=held, headers=AUTH)).status == 202
    await engine.versions.settled()
    pinned = {"model": "a", "version": "2"}
    answer = await client.post("/api/inference", json={"input": "x"} | pinned)
    assert (await answer.json())["output"] == "a@2||x"
    hold = client.post("/api/inference", json={"input": "hold"} | pinned)
    in_flight = asyncio.ensure_future(hold)
    assert await asyncio.to_thread(sample_models.HOLD_ENTERED.wait, HANG_GUARD_S)
    removed = await client.delete(ROUTE, headers=AUTH)
    assert (removed.status, (await removed.json())["state"]) == (202, "draining")
    sample_models.HOLD_RELEASE.set()
    assert (await (await in_flight).json())["output"] == "a@2||hold"
    await engine.versions.settled()
    assert list(await versions(client)) == ["1"]
    scrape = await (await client.get("/metrics")).text()
    assert [line for line in scrape.splitlines() if 'version="2"' in line] == []


async def test_a_version_whose_warm_up_fails_serves_only_where_it_passed(
    served, caplog, monkeypatch
):
    client, engine = served
    cold = {"fn_per_device": "tests.sample_models:cold_on_sim1", "devices": "sim:2"}
    assert (await client.put(ROUTE, json=cold, headers=AUTH)).status == 202
    await engine.versions.settled()
    assert (await versions(client))["2"]["devices"] == ["sim:0"]
    assert "device sim:1 failed to load a@2: its warm-up batch failed" in caplog.text
    for n in range(4):
        answer = await client.post(
            "/api/inference", json={"input": f"x{n}", "model": "a", "version": "2"}
        )
        assert (await answer.json())["output"] == f"warm|x{n}"
    monkeypatch.setenv("BATCHSERVE_TEST_COLD", "*")  # now it fails everywhere: not added
    other = "/admin/models/a/versions/3"
    assert (await client.put(other, json=cold, headers=AUTH)).status == 202
    await engine.versions.settled()
    assert "3" not in await versions(client)
    assert "a@3 loaded on no device and is not added" in caplog.text


async def test_an_admin_key_that_is_not_utf_8_is_401(served):
    client, _ = served
    for method in (b"PUT", b"PATCH", b"DELETE"):
        request = raw_http.post(
            ROUTE, b"{}", b"Authorization: Bearer \xffadmin", b"Connection: close"
        ).replace(b"POST", method, 1)
        [answer] = await raw_http.exchange(client.host, client.port, request)
        assert (answer.status, answer.json()["error"]) == (401, "UNAUTHENTICATED"), method
    assert list(await versions(client)) == ["1"]
