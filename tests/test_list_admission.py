"""A request of several inputs (OIP, /v1/embeddings) is admitted all or nothing: it spends its
tenant's tokens at once, a list over the tier's burst is 400 (no retry lets it in), and no
input of a refused list reaches a device."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.models.specs import ModelSpec
from batchserve.rules.tenants import TokenBucket
from batchserve.server import create_app

from . import sample_models
from .conftest import BatchserveTestServer, GatedBackend

KEYS = """
[keys."sk-free"]
tenant = "hobby"
tier = "free"

[tiers.free]
rate = 0.001
burst = 3
"""
FREE = {"Authorization": "Bearer sk-free"}


def oip(texts: list[str]) -> dict[str, object]:
    return {
        "inputs": [{"name": "input", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]
    }


@pytest.fixture
async def client(aiohttp_client, tmp_path: Path, gated: GatedBackend):
    """Model "echo" (the gated backend, its gate open: it records every call) and an
    embedder "tiny", for a free tenant with a burst of 3 and no refill to speak of."""
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    gated.gate.set()
    engine = Engine(
        Config(keys_file=str(keys), max_input_bytes=16),
        models=[
            ModelSpec(name="echo", version="1", fn_per_device=gated, devices="sim:1"),
            ModelSpec(
                name="tiny", version="1", fn_per_device=sample_models.tiny_embedder,
                devices="sim:1",
            ),
        ],
    )  # fmt: skip
    return await aiohttp_client(BatchserveTestServer(create_app(engine)))


def test_a_bucket_takes_several_tokens_all_or_none():
    bucket = TokenBucket(rate=1.0, burst=3.0, tokens=2.0, updated=0.0)
    assert bucket.take(0.0, 3) == pytest.approx(1.0)  # one more token is a second away
    assert bucket.tokens == pytest.approx(2.0)  # none spent by the refusal
    assert bucket.take(1.0, 3) == 0.0
    assert bucket.tokens == pytest.approx(0.0)


async def test_a_list_over_the_tiers_burst_is_400_and_none_of_it_runs(client, gated):
    over = await client.post("/v2/models/echo/infer", json=oip(["a", "b", "c", "d"]), headers=FREE)
    body = await over.json()
    assert (over.status, body["code"]) == (400, "OVER_TIER_BURST")
    assert "free tier takes at most 3" in body["error"]
    assert "Retry-After" not in over.headers  # no wait lets 4 strings into a burst of 3
    embeddings = await client.post(
        "/v1/embeddings", json={"model": "tiny", "input": ["a", "b", "c", "d"]}, headers=FREE
    )
    assert embeddings.status == 400
    assert (await embeddings.json())["error"]["code"] == "OVER_TIER_BURST"
    assert gated.calls == []
    # The refusals spent no tokens: the whole burst is left for a list that fits it.
    fits = await client.post("/v2/models/echo/infer", json=oip(["a", "b", "c"]), headers=FREE)
    assert fits.status == 200
    assert sorted(gated.seen_inputs()) == ["a", "b", "c"]


async def test_a_list_the_bucket_cannot_hold_now_is_429_and_none_of_it_runs(client, gated):
    one = await client.post("/v2/models/echo/infer", json=oip(["x"]), headers=FREE)
    assert one.status == 200
    limited = await client.post("/v2/models/echo/infer", json=oip(["a", "b", "c"]), headers=FREE)
    assert limited.status == 429  # two tokens left, three asked: it may fit later
    assert "Retry-After" in limited.headers
    assert gated.seen_inputs() == ["x"]
    fits = await client.post("/v2/models/echo/infer", json=oip(["a", "b"]), headers=FREE)
    assert fits.status == 200  # the 429 spent none of the two


async def test_any_input_refused_withdraws_the_whole_list(client, gated):
    refused = await client.post(
        "/v2/models/echo/infer", json=oip(["a", "b" * 17, "c"]), headers=FREE
    )
    assert (refused.status, (await refused.json())["code"]) == (413, "INPUT_TOO_LARGE")
    assert gated.calls == []  # "a" was admitted, then withdrawn before any batch formed
