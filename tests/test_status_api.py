"""Submit, then poll: POST /api/requests and GET /api/requests/{id}, in-process."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient

from batchserve.backends import POISON_MARKER, simulated_factory
from batchserve.clock import FakeClock

from .conftest import reach


async def poll(client: TestClient, request_id: str) -> dict[str, object]:
    response = await client.get(f"/api/requests/{request_id}")
    assert response.status == 200
    return dict(await response.json())


async def poll_until_done(client: TestClient, request_id: str) -> dict[str, object]:
    for _ in range(10_000):
        answer = await poll(client, request_id)
        if answer["status"] in {"completed", "failed"}:
            return answer
        await asyncio.sleep(0)
    raise AssertionError(f"{request_id} never finished")


async def submit(client: TestClient, text: str, **headers: str) -> str:
    response = await client.post("/api/requests", json={"input": text}, headers=headers)
    assert response.status == 202
    body = await response.json()
    assert body["status"] == "queued"
    assert response.headers["Location"] == f"/api/requests/{body['request_id']}"
    return str(body["request_id"])


async def test_a_request_goes_queued_running_completed(start_server, gated):
    client, engine = await start_server(gated)
    first = await submit(client, "first")
    await reach(engine, lambda s: s.in_flight == 1)
    second = await submit(client, "second")
    assert (await poll(client, first))["status"] == "running"
    assert (await poll(client, second))["status"] == "queued"
    gated.gate.set()
    done = await poll_until_done(client, second)
    assert done["status"] == "completed"
    assert done["output"] == "dnoces"
    assert done["request_id"] == second
    assert {"latency_ms", "queue_ms", "compute_ms", "batch_size"} <= done.keys()
    assert (await poll_until_done(client, first))["output"] == "tsrif"
    assert engine.stats().pending == 0


async def test_a_failing_request_reports_its_error(start_server, gated):
    gated.gate.set()
    client, _ = await start_server(gated)
    request_id = await submit(client, f"bad{POISON_MARKER}")
    failed = await poll_until_done(client, request_id)
    assert failed["status"] == "failed"
    assert failed["error"]["error"] == "BACKEND_ERROR"  # type: ignore[index]
    assert "poison" in failed["error"]["message"]  # type: ignore[index]


async def test_a_deadline_passes_while_queued(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(gated, clock=clock)
    response = await client.post("/api/requests", json={"input": "slow", "timeout_ms": 20})
    request_id = (await response.json())["request_id"]
    assert (await poll(client, request_id))["status"] in {"queued", "running"}
    clock.advance(0.020)
    failed = await poll_until_done(client, request_id)
    assert failed["error"]["error"] == "DEADLINE_EXCEEDED"  # type: ignore[index]
    gated.gate.set()
    assert engine.stats().pending == 0


async def test_unknown_duplicate_invalid_and_expired_ids(start_server, gated):
    client, _ = await start_server(gated, result_ttl_s=0)
    missing = await client.get("/api/requests/nobody")
    assert missing.status == 404
    assert (await missing.json())["error"] == "NOT_FOUND"
    await submit(client, "x", **{"X-Request-Id": "mine"})
    again = await client.post(
        "/api/requests", json={"input": "y"}, headers={"X-Request-Id": "mine"}
    )
    assert again.status == 409
    bad = await client.post("/api/requests", data=b"not json")
    assert (bad.status, (await bad.json())["error"]) == (400, "INVALID_INPUT")
    gated.gate.set()
    for _ in range(10_000):  # result_ttl_s=0: gone as soon as it has finished
        if (await client.get("/api/requests/mine")).status == 404:
            break
        await asyncio.sleep(0)
    else:
        raise AssertionError("the finished result never expired")


async def test_many_submitted_requests_each_get_their_own_answer(start_server):
    client, engine = await start_server(simulated_factory(0.002, 100), devices=2)
    texts = [f"async-{n}" for n in range(300)]
    ids = await asyncio.gather(*(submit(client, text) for text in texts))
    answers = [await poll_until_done(client, request_id) for request_id in ids]
    assert [answer["output"] for answer in answers] == [text[::-1] for text in texts]
    assert engine.stats().pending == 0
