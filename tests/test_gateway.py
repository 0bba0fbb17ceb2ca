"""The Kubernetes inference gateway: the load its endpoint picker scrapes, and its headers."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import zlib

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Prompt
from batchserve.models.generators import Seq, SimulatedGenerator
from batchserve.models.specs import ModelSpec
from batchserve.rules.gateway import BUCKETS, FAIRNESS_ID, OBJECTIVE, SLO_TTFT_MS

from .conftest import HANG_GUARD_S, TWO_TENANT_KEYS, reach

PICKER_NAMES = {
    "waiting": ("batchserve_requests_waiting", "vllm:num_requests_waiting"),
    "running": ("batchserve_requests_running", "vllm:num_requests_running"),
    "utilization": (
        "batchserve_utilization",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ),
}


def picker_view(text: str) -> dict[str, float]:
    """What the picker reads: one unlabelled gauge per name, each alias equal."""
    families = {family.name: family for family in text_string_to_metric_families(text)}
    view = {}
    for key, names in PICKER_NAMES.items():
        values = set()
        for name in names:
            family = families[name]
            assert family.type == "gauge"
            [sample] = family.samples
            assert sample.labels == {}
            values.add(sample.value)
        [view[key]] = values
    return view


async def scraped(client) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The picker's view from /metrics, which /metrics/picker (its gauges alone) matches."""
    whole, alone = await client.get("/metrics"), await client.get("/metrics/picker")
    assert whole.status == alone.status == 200
    view, picker_text = picker_view(await whole.text()), await alone.text()
    assert picker_view(picker_text) == view
    served = {family.name for family in text_string_to_metric_families(picker_text)}
    assert served == {name for names in PICKER_NAMES.values() for name in names} | {
        "vllm:lora_requests_info"
    }
    return view


async def test_a_burst_raises_waiting_bounds_running_and_saturates_utilization(start_server, gated):
    devices, max_batch = 2, 4
    client, engine = await start_server(
        gated, devices=devices, clock=FakeClock(), max_batch_size=max_batch
    )
    assert await scraped(client) == {"waiting": 0, "running": 0, "utilization": 0}
    first = asyncio.ensure_future(client.post("/api/inference", json={"input": "a"}))
    await reach(engine, lambda s: s.in_flight == 1)
    assert await scraped(client) == {"waiting": 0, "running": 1, "utilization": 1 / 8}
    burst = [
        asyncio.ensure_future(client.post("/api/inference", json={"input": f"x{n}"}))
        for n in range(29)
    ]
    await reach(engine, lambda s: s.queued + s.in_flight == 30 and s.free_devices == 0)
    view = await scraped(client)
    assert view["waiting"] + view["running"] == 30
    assert 2 <= view["running"] <= devices * max_batch
    assert view["waiting"] >= 30 - devices * max_batch
    assert view["utilization"] == 1.0
    gated.gate.set()
    assert {(await answer).status for answer in [first, *burst]} == {200}
    await reach(engine, lambda s: s.pending == 0 and s.in_flight == 0)
    assert await scraped(client) == {"waiting": 0, "running": 0, "utilization": 0}


class GatedGenerator(SimulatedGenerator):
    """The simulated generator, instant, whose steps wait for `gate` once `entered` is set."""

    def __init__(self, device: str, budget: int) -> None:
        super().__init__(device, fixed_s=0.0, per_token_s=0.0, kv_budget_tokens=budget)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def step(self, seqs: list[Seq]) -> list[str | None]:
        self.entered.set()
        assert self.gate.wait(HANG_GUARD_S), "the test never opened the gate"
        return super().step(seqs)


async def test_generation_utilization_is_the_kv_budget_in_use():
    made: list[GatedGenerator] = []

    def load(device: str) -> GatedGenerator:
        made.append(GatedGenerator(device, budget=100))
        return made[-1]

    spec = ModelSpec(name="writer", version="1", generator=load, devices="sim:1")  # type: ignore[arg-type]
    engine = Engine(Config(), models=[spec])
    try:
        async with engine:
            assert engine.metrics is not None
            registry = engine.metrics.registry
            assert picker_view(generate_latest(registry).decode())["utilization"] == 0
            prompts = [f"{n:02d}" + "abcdefghij" * 2 for n in range(12)]  # 22 tokens each

            async def generated(prompt: str) -> str:
                async with engine.generate(Prompt(prompt, max_tokens=8)) as gen:
                    return await gen.result()

            asked = [asyncio.ensure_future(generated(p)) for p in prompts]
            [generator] = made
            assert await asyncio.to_thread(generator.entered.wait, HANG_GUARD_S)
            view = picker_view(generate_latest(registry).decode())
            (row,) = engine.metrics.snapshot()["generation"]
            assert view["running"] == row["running"] >= 1
            assert view["waiting"] == row["waiting"] == len(prompts) - row["running"] > 0
            # the running prompts fill the budget but for less than one more prompt
            assert view["utilization"] == row["kv_used_tokens"] / 100
            assert 1 - 30 / 100 <= view["utilization"] <= 1
            generator.gate.set()
            assert [len(out) for out in await asyncio.gather(*asked)] == [8] * len(prompts)
            assert picker_view(generate_latest(registry).decode())["utilization"] == 0
    finally:
        for generator in made:
            generator.gate.set()


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "batchserve.access"]


GATEWAY_HEADERS = {FAIRNESS_ID: "team-7", OBJECTIVE: "Sheddable"}


async def test_gateway_headers_are_ignored_unless_trusted(start_server, gated, caplog):
    caplog.set_level(logging.INFO, logger="batchserve.access")
    gated.gate.set()
    client, _ = await start_server(gated, access_log=True)
    answer = await client.post("/api/inference", json={"input": "x"}, headers=GATEWAY_HEADERS)
    assert answer.status == 200
    [line] = access_lines(caplog)
    assert line["tenant"] is None


async def test_trusted_headers_pick_a_bounded_tenant_and_a_tier(start_server, gated, caplog):
    caplog.set_level(logging.INFO, logger="batchserve.access")
    gated.gate.set()
    client, _ = await start_server(gated, access_log=True, trust_gateway_headers=True)
    for n in range(3 * BUCKETS):  # more fairness ids than there are gateway tenants
        headers = {FAIRNESS_ID: f"team-{n}", OBJECTIVE: "Sheddable"}
        answer = await client.post("/api/inference", json={"input": "x"}, headers=headers)
        assert answer.status == 200
    critical = {FAIRNESS_ID: "team-0", OBJECTIVE: "critical"}
    assert (await client.post("/api/inference", json={"input": "x"}, headers=critical)).ok
    plain = await client.post("/api/inference", json={"input": "x"})
    assert plain.ok
    *sheddable, critical_line, plain_line = access_lines(caplog)
    tenants = {line["tenant"] for line in sheddable}
    assert len(tenants) <= BUCKETS
    assert all(str(name).startswith("gateway:free:") for name in tenants)
    assert str(critical_line["tenant"]).startswith("gateway:enterprise:")
    assert plain_line["tenant"] is None  # no gateway header: as without the flag
    response = await client.get("/metrics")
    tiers = {
        sample.labels["tier"]
        for family in text_string_to_metric_families(await response.text())
        if family.name == "batchserve_requests"
        for sample in family.samples
    }
    assert tiers == {"free", "enterprise", "none"}  # labelled by tier, never by fairness id


async def test_trusted_slo_header_lowers_the_deadline_and_never_raises_it(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(
        gated, clock=clock, timeout_ms=1000, trust_gateway_headers=True
    )
    running = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "a"}, headers={SLO_TTFT_MS: "5000"})
    )
    await reach(engine, lambda s: s.in_flight == 1)
    hurried = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "b"}, headers={SLO_TTFT_MS: "50"})
    )
    await reach(engine, lambda s: s.queued == 1)
    clock.advance(0.05)
    assert (await hurried).status == 504  # 50 ms, not the server's 1000
    clock.advance(0.95)
    assert (await running).status == 504  # 1000 ms: 5000 did not raise it
    bad = await client.post("/api/inference", json={"input": "c"}, headers={SLO_TTFT_MS: "soon"})
    assert bad.status == 400
    assert SLO_TTFT_MS in (await bad.json())["message"]


async def test_untrusted_slo_header_changes_no_deadline(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(gated, clock=clock, timeout_ms=1000)
    asked = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "a"}, headers={SLO_TTFT_MS: "50"})
    )
    await reach(engine, lambda s: s.in_flight == 1)
    clock.advance(0.5)
    gated.gate.set()
    assert (await asked).status == 200


async def test_with_keys_only_an_operator_key_may_name_the_tenant(
    start_server, gated, caplog, tmp_path
):
    caplog.set_level(logging.INFO, logger="batchserve.access")
    gated.gate.set()
    keys = tmp_path / "keys.toml"
    keys.write_text(TWO_TENANT_KEYS + '\n[keys."sk-gw"]\ntenant = "gw"\ntier = "paid"\n'
                    'role = "operator"\n')  # fmt: skip
    client, _ = await start_server(
        gated, access_log=True, keys_file=str(keys), trust_gateway_headers=True
    )
    asks = [
        ("sk-gw", {FAIRNESS_ID: "alice"}),  # the gateway names a keys-file tenant
        ("sk-gw", {FAIRNESS_ID: "someone-new", OBJECTIVE: "standard"}),
        ("sk-bob", {FAIRNESS_ID: "alice", OBJECTIVE: "critical"}),  # a tenant's own key
        ("sk-bob", {OBJECTIVE: "sheddable"}),
    ]
    for key, headers in asks:
        headers = {**headers, "Authorization": f"Bearer {key}"}
        assert (await client.post("/api/inference", json={"input": "x"}, headers=headers)).ok
    named, new, claimed, lowered = access_lines(caplog)
    assert named["tenant"] == "alice"
    assert str(new["tenant"]).startswith("gateway:paid:")
    assert claimed["tenant"] == lowered["tenant"] == "bob"
    response = await client.get("/metrics", headers={"Authorization": "Bearer sk-gw"})
    by_tier = {
        sample.labels["tier"]: sample.value
        for family in text_string_to_metric_families(await response.text())
        if family.name == "batchserve_requests"
        for sample in family.samples
        if sample.name == "batchserve_requests_total"
    }
    assert by_tier == {"paid": 3, "free": 1}  # bob's critical stayed paid; sheddable went down


async def test_a_request_submitted_through_the_gateway_is_polled_as_the_same_tenant(
    start_server, gated
):
    client, _ = await start_server(gated, trust_gateway_headers=True)
    gated.gate.set()
    for headers in ({OBJECTIVE: "standard"}, {FAIRNESS_ID: "team-7", OBJECTIVE: "critical"}):
        submitted = await client.post("/api/requests", json={"input": "x"}, headers=headers)
        assert submitted.status == 202
        polled = await client.get(
            submitted.headers["Location"], params={"wait_ms": "5000"}, headers=headers
        )
        assert polled.status == 200, await polled.text()
        assert (await polled.json())["status"] == "completed"
        other = await client.get(
            submitted.headers["Location"], headers={FAIRNESS_ID: "someone-else"}
        )
        assert other.status == 404  # another tenant's ids look unknown


def bucket_mates() -> tuple[str, str]:
    """Two fairness ids that hash onto the same one of the BUCKETS gateway tenants."""
    seen: dict[int, str] = {}
    for n in range(10 * BUCKETS):
        fairness_id = f"team-{n}"
        index = zlib.crc32(fairness_id.encode()) % BUCKETS
        if index in seen:
            return seen[index], fairness_id
        seen[index] = fairness_id
    raise AssertionError("no two ids share a bucket")


async def test_request_ids_are_each_fairness_ids_own_whatever_its_bucket_or_objective(
    start_server, gated
):
    client, engine = await start_server(gated, trust_gateway_headers=True)
    first, mate = bucket_mates()
    same_id = {"X-Request-Id": "report-1"}
    mine = {FAIRNESS_ID: first, OBJECTIVE: "sheddable", **same_id}
    theirs = {FAIRNESS_ID: mate, OBJECTIVE: "sheddable", **same_id}
    submitted = await client.post("/api/requests", json={"input": "secret"}, headers=mine)
    assert submitted.status == 202
    await reach(engine, lambda s: s.in_flight == 1)
    # The bucket-mate may use the same id, in flight too, and never reads the other's.
    held = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "own"}, headers=theirs)
    )
    await reach(engine, lambda s: s.queued == 1)
    gated.gate.set()
    assert (await held).status == 200
    location = submitted.headers["Location"]
    assert (await client.get(location, headers={FAIRNESS_ID: mate})).status == 404
    # The submitter polls with another objective (another tier): still its own request.
    polled = await client.get(
        location, params={"wait_ms": "5000"}, headers={FAIRNESS_ID: first, OBJECTIVE: "critical"}
    )
    assert polled.status == 200
    assert (await polled.json())["output"] == "terces"
