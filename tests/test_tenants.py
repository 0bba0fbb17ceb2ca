"""API keys, tiers and rate limits: the key ring and buckets with time passed in, then HTTP."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from batchserve.clock import FakeClock
from batchserve.errors import StartupError
from batchserve.models.backends import simulated_factory
from batchserve.rules import fair_queue
from batchserve.rules.tenants import TIER_RANKS, TIERS, KeyRing, Tenant, TokenBucket

from . import raw_http
from .conftest import GatedBackend, reach

KEYS = """
[keys."sk-ent-123"]
tenant = "acme"
tier = "enterprise"

[keys."sk-free-1"]
tenant = "hobby"
tier = "free"

[keys."sk-free-2"]
tenant = "tinker"
tier = "free"
weight = 3

[tiers.free]
rate = 0.001
burst = 2
timeout_ms = 1500
"""


def test_the_tiers_are_listed_once_and_ranked_from_that_list():
    # The keys file's tiers and the batch order's ranks are one list: enterprise first.
    assert TIER_RANKS == {"enterprise": 0, "paid": 1, "free": 2}
    assert list(TIER_RANKS) == list(reversed(TIERS))
    assert len(TIERS) == fair_queue.IDLE_RANK  # the Batch API's lines, below every tier
    assert [Tenant("t", tier).rank for tier in TIERS] == [2, 1, 0]


@pytest.fixture
def keys_file(tmp_path: Path) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS)
    return str(path)


def test_keys_map_to_tenants_and_tiers_and_unknown_keys_to_nobody(keys_file):
    ring = KeyRing.load(keys_file, anonymous_tier=None)
    assert ring.authenticate("Bearer sk-ent-123") == Tenant("acme", "enterprise")
    assert ring.authenticate("bearer sk-free-1") == Tenant("hobby", "free")
    assert ring.authenticate("Bearer sk-free-2") == Tenant("tinker", "free", weight=3.0)
    for header in (None, "", "Bearer", "Bearer sk-ent-12", "Bearer sk-ent-1234", "Basic x"):
        assert ring.authenticate(header) is None
    anonymous = KeyRing.load(keys_file, anonymous_tier="free")
    assert anonymous.authenticate("Bearer wrong") == Tenant("anonymous", "free")
    assert anonymous.limits["free"].rate == 0.001  # the file pins the free tier's rate
    assert anonymous.limits["paid"].rate is None  # the others follow the live capacity
    assert anonymous.limits["paid"].share == 0.1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[keys."sk-secret"]\ntenant = "a"\ntier = "gold"\n', "key number 1 needs"),
        ('[keys."sk-secret"]\ntenant = "a"\ntier = "free"\nweight = 0\n', "weight above 0"),
        ("[tiers.gold]\nrate = 1\n", "unknown tier 'gold'"),
        ("[tiers.free]\nspeed = 1\n", "takes share, rate, burst and timeout_ms"),
        ("[tiers.free]\nshare = 0\n", "share and rate must be > 0"),
        ("not toml [", "--keys-file"),
    ],
)
def test_bad_keys_files_stop_start_up_without_printing_a_key(tmp_path, text, message):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(StartupError, match="keys-file") as raised:
        KeyRing.load(str(path), anonymous_tier=None)
    assert message in str(raised.value)
    assert "sk-secret" not in str(raised.value)


def test_the_reserved_anonymous_tenant_name_stops_start_up_naming_its_line(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(
        '[keys."sk-secret-1"]\ntenant = "acme"\ntier = "paid"\n\n'
        '[keys."sk-secret-2"]\ntenant = "anonymous"\ntier = "free"\n'
    )
    with pytest.raises(StartupError, match="keys-file") as raised:
        KeyRing.load(str(path), anonymous_tier="free")
    message = str(raised.value)
    assert "line 6 (key number 2)" in message
    assert "'anonymous' is reserved" in message
    assert "sk-secret" not in message


def test_tier_rates_are_shares_of_the_live_capacity_unless_pinned(keys_file):
    ring = KeyRing.load(keys_file, anonymous_tier=None)
    acme, hobby = Tenant("acme", "enterprise"), Tenant("hobby", "free")
    paid = Tenant("shop", "paid")
    assert ring.take(paid, 0.0, None)[1].rate == 100.0  # unmeasured: one burst a second
    assert ring.take(paid, 0.0, 2000.0)[1].rate == pytest.approx(150.0)  # 0.1 x 0.75 x 2000
    assert ring.take(acme, 0.0, 2000.0)[1].rate == pytest.approx(1500.0)
    # A device hangs: the capacity halves, and so does every share-based rate, at once.
    assert ring.take(paid, 0.0, 1000.0)[1].rate == pytest.approx(75.0)
    assert ring.take(hobby, 0.0, 1000.0)[1].rate == 0.001  # pinned by the file
    # Tokens accrued at the rate they accrued at: 1 s at 75 a second, capped by the burst.
    bucket = ring.take(paid, 0.0, 1000.0)[1]
    tokens = bucket.tokens
    ring.take(paid, 0.5, 4000.0)
    assert bucket.tokens == pytest.approx(min(100.0, tokens + 0.5 * 75.0) - 1)
    assert bucket.rate == pytest.approx(300.0)


def test_token_bucket_refills_at_its_rate_up_to_its_burst():
    bucket = TokenBucket(rate=2.0, burst=3.0, tokens=3.0, updated=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)  # one token takes half a second
    assert bucket.take(0.5) == 0.0
    assert bucket.take(100.0) == 0.0  # a long pause refills only up to the burst
    assert bucket.tokens == pytest.approx(2.0)
    assert bucket.seconds_to_full() == pytest.approx(0.5)


async def test_requests_need_a_known_key_and_get_answered_as_their_tenant(
    start_server, keys_file, caplog
):
    caplog.set_level("INFO", logger="batchserve.access")
    client, _ = await start_server(simulated_factory(0.0, 100), keys_file=keys_file,
                                   access_log=True, admin_key="sk-admin")  # fmt: skip
    missing = await client.post("/api/inference", json={"input": "x"})
    assert missing.status == 401
    assert (await missing.json())["error"] == "UNAUTHENTICATED"
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    wrong = await client.post(
        "/api/inference", json={"input": "x"}, headers={"Authorization": "Bearer sk-nope"}
    )
    assert wrong.status == 401
    ok = await client.post(
        "/api/inference", json={"input": "abc"}, headers={"Authorization": "Bearer sk-ent-123"}
    )
    assert (ok.status, (await ok.json())["output"]) == (200, "cba")
    assert '"tenant":"acme"' in caplog.text
    assert "sk-" not in caplog.text  # keys are never logged
    admin = {"Authorization": "Bearer sk-admin"}  # the numbers need an operator's key
    metrics = await (await client.get("/metrics", headers=admin)).text()
    assert (
        'code="200",error="",model="default",route="inference",tier="enterprise",version="1"'
        in metrics
    )


async def test_a_tenant_over_its_rate_gets_429_with_rate_limit_headers(start_server, keys_file):
    client, _ = await start_server(simulated_factory(0.0, 100), keys_file=keys_file)
    hobby = {"Authorization": "Bearer sk-free-1"}
    statuses = [
        (await client.post("/api/inference", json={"input": "x"}, headers=hobby)).status
        for _ in range(2)
    ]
    assert statuses == [200, 200]  # the burst
    limited = await client.post("/api/inference", json={"input": "x"}, headers=hobby)
    assert limited.status == 429
    body = await limited.json()
    assert body["error"] == "RATE_LIMITED"
    assert body["retry_after_ms"] > 0
    assert int(limited.headers["Retry-After"]) >= 1
    assert limited.headers["RateLimit-Limit"] == "0.001"  # the tier's rate, pinned here
    assert limited.headers["RateLimit-Remaining"] == "0"
    assert int(limited.headers["RateLimit-Reset"]) >= 1
    other = await client.post(
        "/api/inference", json={"input": "x"}, headers={"Authorization": "Bearer sk-free-2"}
    )
    assert other.status == 200  # each tenant has its own bucket


async def test_the_anonymous_tier_serves_requests_without_a_key(start_server, keys_file):
    client, _ = await start_server(
        simulated_factory(0.0, 100), keys_file=keys_file, anonymous_tier="free"
    )
    assert (await client.post("/api/inference", json={"input": "x"})).status == 200


async def test_a_tier_deadline_caps_the_request_timeout(start_server, tmp_path, gated):
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS.replace("timeout_ms = 1500", "timeout_ms = 50"))
    clock = FakeClock()
    client, engine = await start_server(gated, keys_file=str(keys), clock=clock)
    asked = asyncio.ensure_future(
        client.post(
            "/api/inference", json={"input": "x"}, headers={"Authorization": "Bearer sk-free-1"}
        )
    )
    await reach(engine, lambda s: s.pending == 1)
    clock.advance(0.050)
    answer = await asked
    assert answer.status == 504  # free's 50 ms deadline, though the server allows 5,000
    gated.gate.set()


async def test_a_tenant_reads_only_its_own_submitted_requests(start_server, keys_file):
    client, _ = await start_server(simulated_factory(0.0, 100), keys_file=keys_file)
    acme = {"Authorization": "Bearer sk-ent-123"}
    submitted = await client.post("/api/requests", json={"input": "mine"}, headers=acme)
    request_id = (await submitted.json())["request_id"]
    for _ in range(10_000):
        own = await client.get(f"/api/requests/{request_id}", headers=acme)
        if (await own.json())["status"] == "completed":
            break
        await asyncio.sleep(0)
    else:
        raise AssertionError("never completed")
    other = await client.get(
        f"/api/requests/{request_id}", headers={"Authorization": "Bearer sk-free-2"}
    )
    assert other.status == 404
    assert (await client.get(f"/api/requests/{request_id}")).status == 401


async def test_requests_predicted_to_miss_their_deadline_are_shed_lowest_tier_first(
    start_server, tmp_path, gated
):
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS.replace("rate = 0.001\nburst = 2\ntimeout_ms = 1500", "timeout_ms = 300"))
    clock = FakeClock()
    client, engine = await start_server(gated, keys_file=str(keys), max_batch_size=1, clock=clock)
    acme = {"Authorization": "Bearer sk-ent-123"}
    hobby = {"Authorization": "Bearer sk-free-1"}
    warm = asyncio.ensure_future(client.post("/api/inference", json={"input": "w"}, headers=acme))
    await reach(engine, lambda s: s.in_flight == 1)
    clock.advance(0.050)
    gated.gate.set()
    assert (await warm).status == 200  # 50 ms measured: capacity 20 requests a second
    gated.gate.clear()
    queued = [
        asyncio.ensure_future(client.post("/api/inference", json={"input": f"q{n}"}, headers=acme))
        for n in range(10)
    ]
    await reach(engine, lambda s: s.queued == 9 and s.in_flight == 1)
    shed = await client.post("/api/inference", json={"input": "late"}, headers=hobby)
    assert shed.status == 503  # 9 enterprise requests queued: ~0.5 s against 300 ms
    body = await shed.json()
    assert body["error"] == "OVERLOADED"
    assert "past its deadline" in body["message"]
    # 9 queued ahead, drained at most one per 50 ms call
    assert body["retry_after_ms"] >= round(9 * 0.050 * 1e3)
    kept = asyncio.ensure_future(client.post("/api/inference", json={"input": "ent"}, headers=acme))
    await reach(engine, lambda s: s.queued == 10)  # enterprise: accepted
    gated.gate.set()
    assert [(await task).status for task in [*queued, kept]] == [200] * 11


async def test_a_request_shed_from_an_empty_queue_leaves_the_batcher_serving(
    start_server, keys_file, gated
):
    """Shedding a request that would have opened a lane must not leave that lane empty:
    the batcher once crashed on it at its next look (IndexError), failing the engine."""
    clock = FakeClock()
    client, engine = await start_server(gated, keys_file=keys_file, clock=clock)
    acme = {"Authorization": "Bearer sk-ent-123"}
    warm = asyncio.ensure_future(client.post("/api/inference", json={"input": "w"}, headers=acme))
    await reach(engine, lambda s: s.in_flight == 1)
    clock.advance(0.050)
    gated.gate.set()
    assert (await warm).status == 200  # a call takes 50 ms
    gated.gate.clear()
    held = asyncio.ensure_future(client.post("/api/inference", json={"input": "h"}, headers=acme))
    await reach(engine, lambda s: s.in_flight == 1 and s.queued == 0)
    shed = await client.post("/api/inference", json={"input": "x", "timeout_ms": 1}, headers=acme)
    assert shed.status == 504  # one call is more than its 1 ms: refused, nothing queued
    assert (await shed.json())["error"] == "DEADLINE_TOO_SHORT"
    gated.gate.set()  # the batch done wakes the batcher, which looks at every lane
    assert (await held).status == 200
    after = await client.post("/api/inference", json={"input": "next"}, headers=acme)
    assert after.status == 200


async def test_a_deadline_shorter_than_one_call_is_the_clients_504_not_shedding(
    start_server, tmp_path, gated
):
    """An impossible deadline, the client's own or the gateway's SLO, is no sign of load:
    504 without Retry-After (never retried), and no rejection for the shedding alert."""
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS + '\n[keys."sk-gw"]\ntenant = "gw"\ntier = "paid"\nrole = "operator"\n')
    clock = FakeClock()
    client, engine = await start_server(
        gated, keys_file=str(keys), clock=clock, trust_gateway_headers=True
    )
    acme = {"Authorization": "Bearer sk-ent-123"}
    warm = asyncio.ensure_future(client.post("/api/inference", json={"input": "w"}, headers=acme))
    await reach(engine, lambda s: s.in_flight == 1)
    clock.advance(0.050)
    gated.gate.set()
    assert (await warm).status == 200  # a call takes 50 ms, and nothing is queued
    own = await client.post("/api/inference", json={"input": "x", "timeout_ms": 1}, headers=acme)
    gateway = {"Authorization": "Bearer sk-gw", "x-gateway-inference-fairness-id": "team-1",
               "x-slo-ttft-ms": "1"}  # fmt: skip
    slo = await client.post("/api/inference", json={"input": "x"}, headers=gateway)
    for answer in (own, slo):
        body = await answer.json()
        assert (answer.status, body["error"]) == (504, "DEADLINE_TOO_SHORT")
        assert "shorter than one batch call" in body["message"]
        assert "Retry-After" not in answer.headers
    metrics = await (await client.get("/metrics", headers={"Authorization": "Bearer sk-gw"})).text()
    assert "batchserve_rejections_total{" not in metrics  # the shedding alert stays quiet
    assert 'code="504",error="DEADLINE_TOO_SHORT"' in metrics
    fits = await client.post("/api/inference", json={"input": "y", "timeout_ms": 60}, headers=acme)
    assert fits.status == 200  # a deadline one call fits is served


async def test_capacity_follows_a_device_that_hangs(start_server, gated: GatedBackend):
    clock = FakeClock()
    client, engine = await start_server(gated, devices=2, batch_timeout_ms=200, clock=clock)
    measure = asyncio.ensure_future(client.post("/api/inference", json={"input": "measure"}))
    await reach(engine, lambda s: s.in_flight == 1)
    clock.advance(0.100)
    gated.gate.set()
    await measure
    assert engine.view.capacity_rps() == pytest.approx(2 * 100 / 0.100)
    gated.stuck = {"sim:0"}
    hangs = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "hangs sim:0, then runs on sim:1"})
    )
    await gated.entered("sim:0")
    await reach(engine, lambda s: s.in_flight == 1 and s.free_devices == 1)
    clock.advance(0.200)
    assert (await hangs).status == 200
    assert engine.stats().healthy_devices == 1
    assert engine.view.capacity_rps() == pytest.approx(1 * 100 / engine.view.call_time_s)
    admin = {"Authorization": "Bearer sk-admin"}  # the numbers need an operator's key
    metrics = await (await client.get("/metrics", headers=admin)).text()
    assert f"batchserve_capacity_rps {engine.view.capacity_rps()}" in metrics


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/api/inference"),
        ("POST", "/api/requests"),
        ("GET", "/api/requests/some-id"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/api/generate"),
        ("GET", "/api/models"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/default"),
        ("GET", "/v2/models/default"),
        ("GET", "/v2/models/default/ready"),
        ("POST", "/v2/models/default/infer"),
        ("GET", "/metrics"),  # these three need an operator key
        ("GET", "/metrics/picker"),
        ("GET", "/api/stats"),
    ],
)
async def test_a_key_that_is_not_utf_8_is_401_like_any_unknown_key(
    start_server, keys_file, method, path
):
    """aiohttp decodes header bytes that are not UTF-8 to lone surrogates, which a plain
    `str.encode` refuses: the key is compared as the bytes the client sent, on every route
    that checks one (the operator check with an admin key set, too)."""
    client, _ = await start_server(
        simulated_factory(0.0, 100), keys_file=keys_file, admin_key="sk-admin"
    )
    body = b'{"input": "abc", "prompt": "abc", "messages": []}'
    request = raw_http.post(path, body, b"Authorization: Bearer sk-\xff\xfe", b"Connection: close")
    if method == "GET":
        request = request.replace(b"POST", b"GET", 1)
    [answer] = await raw_http.exchange(client.host, client.port, request)
    body = answer.json()
    error = body["error"]  # OpenAI's shape nests the code, OIP's puts it beside
    code = error["code"] if isinstance(error, dict) else body.get("code", error)
    assert (answer.status, code) == (401, "UNAUTHENTICATED")
    assert answer.headers["www-authenticate"] == "Bearer"


OPERATOR_KEYS = (
    KEYS
    + """
[keys."sk-ops"]
tenant = "ops"
tier = "free"
role = "operator"
"""
)


@pytest.mark.parametrize("public", [False, True])
async def test_with_keys_the_numbers_need_an_operator_key_and_models_a_key(
    start_server, tmp_path, public
):
    path = tmp_path / "keys.toml"
    path.write_text(OPERATOR_KEYS)
    client, _ = await start_server(
        simulated_factory(0.0, 100), keys_file=str(path), admin_key="sk-admin",
        public_metrics=public,
    )  # fmt: skip
    tenant, operator = "Bearer sk-ent-123", "Bearer sk-ops"
    for path_ in ("/metrics", "/api/stats"):
        for authorization, allowed in (
            (None, public), (tenant, public), ("Bearer wrong", public),
            (operator, True), ("Bearer sk-admin", True),
        ):  # fmt: skip
            headers = {"Authorization": authorization} if authorization else {}
            answer = await client.get(path_, headers=headers)
            assert answer.status == (200 if allowed else 401), (path_, authorization)
            if not allowed:
                assert (await answer.json())["error"] == "UNAUTHENTICATED"
    for path_ in ("/api/models", "/v1/models", "/v1/models/default"):
        assert (await client.get(path_)).status == 401
        assert (await client.get(path_, headers={"Authorization": tenant})).status == 200
    assert (await client.get("/")).status == 200  # the page holds no numbers


def test_a_role_other_than_tenant_or_operator_stops_start_up(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[keys."sk-secret"]\ntenant = "a"\ntier = "free"\nrole = "admin"\n')
    with pytest.raises(StartupError, match="role of tenant or operator"):
        KeyRing.load(str(path), anonymous_tier=None)
