"""Request ids are per tenant: another tenant's id looks unknown (404, never 409) and cannot
be squatted; an embeddings call's parts never collide with an id a client sends."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from batchserve.devices.loading import WARM_UP_INPUT
from batchserve.models.backends import simulate

from .conftest import TWO_TENANT_KEYS, GatedBackend, reach

ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


@pytest.fixture
def keys_file(tmp_path: Path) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(TWO_TENANT_KEYS)
    return str(path)


async def test_a_submitted_id_is_the_tenants_own_and_another_cannot_squat_it(
    start_server, gated: GatedBackend, keys_file
):
    client, _ = await start_server(gated, keys_file=keys_file)
    gated.gate.set()
    unknown = await client.get("/api/requests/shared-id", headers=BOB)
    own = await client.post(
        "/api/requests", json={"input": "alice's"}, headers={**ALICE, "X-Request-Id": "shared-id"}
    )
    assert own.status == 202
    # Bob sees no trace of Alice's request: the same 404 as before it existed...
    peek = await client.get("/api/requests/shared-id", headers=BOB)
    assert (peek.status, await peek.json()) == (unknown.status, await unknown.json())
    assert peek.status == 404
    # ...and may use the id himself: 202, not a 409 that would tell him it is taken.
    his = await client.post(
        "/api/requests", json={"input": "bob's"}, headers={**BOB, "X-Request-Id": "shared-id"}
    )
    assert his.status == 202
    for headers, text in ((ALICE, "alice's"), (BOB, "bob's")):
        polled = await client.get("/api/requests/shared-id?wait_ms=60000", headers=headers)
        body = await polled.json()
        assert (body["status"], body["output"]) == ("completed", simulate(text))
    again = await client.post(
        "/api/requests", json={"input": "x"}, headers={**ALICE, "X-Request-Id": "shared-id"}
    )
    assert again.status == 409  # still held, and Alice's own: she may be told


async def test_an_id_in_flight_for_one_tenant_is_free_for_another(
    start_server, gated: GatedBackend, keys_file
):
    client, engine = await start_server(gated, keys_file=keys_file)
    first = asyncio.ensure_future(
        client.post(
            "/api/inference", json={"input": "a"}, headers={**ALICE, "X-Request-Id": "same"}
        )
    )
    await reach(engine, lambda s: s.in_flight == 1)
    second = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "b"}, headers={**BOB, "X-Request-Id": "same"})
    )
    await reach(engine, lambda s: s.queued == 1)
    gated.gate.set()
    answers = [await (await task).json() for task in (first, second)]
    assert [answer["output"] for answer in answers] == ["a", "b"]


class GatedEmbedder:
    """One-number vectors, once `gate` opens (its load's warm-up passes at once)."""

    embedding_dim = 1

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def __call__(self, inputs: list[str]) -> list[list[float]]:
        if inputs != [WARM_UP_INPUT]:
            assert self.gate.wait(60), "the test never opened the gate"
        return [[float(len(text))] for text in inputs]


async def test_an_embeddings_parts_never_collide_with_a_clients_id(start_server):
    gate = threading.Event()
    try:
        client, engine = await start_server(lambda device: GatedEmbedder(gate))
        embedding = asyncio.ensure_future(
            client.post(
                "/v1/embeddings",
                json={"model": "default", "input": ["ab", "abc"]},
                headers={"X-Request-Id": "e"},
            )
        )
        await reach(engine, lambda s: s.in_flight == 2)  # its parts, e.0 and e.1, run
        plain = asyncio.ensure_future(
            client.post("/api/inference", json={"input": "abcd"}, headers={"X-Request-Id": "e.1"})
        )
        await reach(engine, lambda s: s.queued == 1)  # accepted, not 409
        gate.set()
        assert (await plain).status == 200
        answer = await (await embedding).json()
        assert [d["embedding"] for d in answer["data"]] == [[2.0], [3.0]]
    finally:
        gate.set()
