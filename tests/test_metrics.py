"""Prometheus metrics, the dashboard's numbers and the access log, in-process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchserve.batching.request import Result
from batchserve.clock import FakeClock
from batchserve.devices.device import BUSY_WINDOW_S, Device
from batchserve.models.backends import POISON_MARKER, simulated_factory
from batchserve.observability.metrics import desired_replicas
from batchserve.observability.window import WINDOW_S, RecentWindow, window_numbers

from . import raw_http
from .conftest import hold_one_and_queue_one, reach, until


async def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(await response.text()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def labels(**pairs: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(pairs.items()))


async def test_metrics_count_answers_by_status_and_time_them(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(gated, devices=2, clock=clock)
    asked = [
        asyncio.ensure_future(client.post("/api/inference", json={"input": f"x{n}"}))
        for n in range(20)
    ]
    await reach(engine, lambda s: s.pending == 20)
    clock.advance(0.25)  # every call in flight now takes 250 ms of virtual time
    gated.gate.set()
    answers = await asyncio.gather(*asked)
    assert {answer.status for answer in answers} == {200}
    await client.post("/api/inference", data=b"not json")
    await client.post("/api/inference", json={"input": f"bad{POISON_MARKER}"})
    samples = await scrape(client)
    model = {"model": "default", "version": "1"}
    ok = labels(route="inference", code="200", tier="none", error="", **model)
    assert samples[("batchserve_requests_total", ok)] == 20
    no_model = {"model": "", "version": ""}
    invalid = labels(route="inference", code="400", tier="none", error="INVALID_INPUT", **no_model)
    assert samples[("batchserve_requests_total", invalid)] == 1
    failed = labels(route="inference", code="500", tier="none", error="BACKEND_ERROR", **no_model)
    assert samples[("batchserve_requests_total", failed)] == 1
    assert samples[("batchserve_request_latency_seconds_count", labels(**model))] == 20
    for name in ("queue_wait", "compute"):
        assert samples[(f"batchserve_{name}_seconds_count", ())] == 20
    batches = engine.stats().batches
    assert samples[("batchserve_batch_size_count", ())] == batches
    # 20 answered; the poison input alone, then alone on the other device, which proves it
    # poison and not its first device broken
    assert samples[("batchserve_batch_size_sum", ())] == 22
    assert samples[("batchserve_device_healthy", labels(device="sim:0"))] == 1
    busy = samples[("batchserve_device_busy_seconds_total", labels(device="sim:0"))]
    assert busy == pytest.approx(0.25)  # its first call; any later ones took no virtual time
    assert samples[("batchserve_faults_total", labels(kind="batch_raised"))] == 2
    assert samples[("batchserve_queue_depth", ())] == 0
    assert samples[("batchserve_capacity_rps", ())] > 0
    assert samples[("batchserve_desired_replicas", ())] >= 1
    assert samples[("batchserve_slo_seconds", ())] == 1.0


async def test_rejections_are_counted_by_reason(start_server, gated):
    client, engine = await start_server(gated, max_queue=1)
    running, queued = await hold_one_and_queue_one(client, engine)
    refused = await client.post("/api/inference", json={"input": "c"})
    assert refused.status == 503
    samples = await scrape(client)
    assert samples[("batchserve_rejections_total", labels(reason="OVERLOADED"))] == 1
    assert samples[("batchserve_queue_depth", ())] == 1
    assert samples[("batchserve_in_flight_batches", ())] == 1
    gated.gate.set()
    assert [(await task).status for task in (running, queued)] == [200, 200]


async def test_stats_give_the_dashboard_live_numbers(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(gated, devices=2, clock=clock)
    asked = [
        asyncio.ensure_future(client.post("/api/inference", json={"input": "x"})) for _ in range(10)
    ]
    await reach(engine, lambda s: s.pending == 10)
    clock.advance(0.1)  # every answer takes exactly 100 ms of virtual time
    gated.gate.set()
    await asyncio.gather(*asked)
    stats = await (await client.get("/api/stats")).json()
    assert stats["throughput_rps"] == 10 / 2.0  # answers in the last two seconds
    assert stats["p50_ms"] == stats["p99_ms"] == pytest.approx(100.0)
    assert [device["name"] for device in stats["devices"]] == ["sim:0", "sim:1"]
    assert sum(int(n) * count for n, count in stats["batch_sizes"].items()) == 10
    [model] = stats["models"]  # the one model the flags define, on the same window
    assert (model["label"], model["state"], model["queued"]) == ("default@1", "ready", 0)
    assert model["throughput_rps"] == stats["throughput_rps"]
    assert model["p99_ms"] == stats["p99_ms"]
    clock.advance(2.001)  # the window has moved past every answer
    assert (await (await client.get("/api/stats")).json())["throughput_rps"] == 0


async def test_within_the_max_age_counters_are_reused_and_the_picker_gauges_fresh(
    start_server, gated
):
    clock = FakeClock()
    client, engine = await start_server(gated, clock=clock, metrics_max_age_ms=500)
    model = {"model": "default", "version": "1"}
    ok = ("batchserve_requests_total", labels(route="inference", code="200", tier="none",
                                              error="", **model))  # fmt: skip
    assert ok not in await scrape(client)  # the full render, at the clock's start
    running, queued = await hold_one_and_queue_one(client, engine)
    samples = await scrape(client)
    assert samples[("vllm:num_requests_waiting", ())] == 1  # the picker's: at once
    assert samples[("batchserve_requests_running", ())] == 1
    assert samples[("batchserve_queue_depth", ())] == 0  # the rest: as rendered
    gated.gate.set()
    assert [(await task).status for task in (running, queued)] == [200, 200]
    samples = await scrape(client)
    assert ok not in samples  # two answers, not yet in the kept render
    assert samples[("vllm:num_requests_waiting", ())] == 0
    assert samples[("batchserve_requests_running", ())] == 0
    clock.advance(0.5)  # the kept render is now as old as allowed
    samples = await scrape(client)
    assert samples[ok] == 2
    await client.post("/api/inference", json={"input": "c"})
    assert (await scrape(client))[ok] == 2
    engine.reconfigure(dataclasses.replace(engine.config, metrics_max_age_ms=0))  # SIGHUP's
    assert (await scrape(client))[ok] == 3


async def test_with_max_age_0_every_scrape_is_generate_latest(start_server, gated):
    gated.gate.set()
    client, engine = await start_server(gated, clock=FakeClock(), metrics_max_age_ms=0)
    assert engine.metrics is not None
    for n in range(3):  # the clock stands still: only max age 0 renders each anew
        await client.post("/api/inference", json={"input": f"x{n}"})
        body = await (await client.get("/metrics")).read()
        assert body == generate_latest(engine.metrics.registry)
        assert f'version="1"}} {n + 1}.0'.encode() in body


async def test_metrics_off_serves_no_metrics(start_server):
    client, _ = await start_server(simulated_factory(0.0, 100), metrics=False)
    assert (await client.get("/metrics")).status == 404
    assert (await client.post("/api/inference", json={"input": "x"})).status == 200


async def test_access_log_has_one_json_line_per_answer_and_never_the_input(start_server, caplog):
    caplog.set_level(logging.INFO, logger="batchserve.access")
    client, _ = await start_server(simulated_factory(0.0, 100), access_log=True)
    await client.post("/api/inference", json={"input": "secret"}, headers={"X-Request-Id": "r1"})
    await client.post("/api/inference", data=b"{}", headers={"X-Request-Id": "r2"})
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "batchserve.access"]
    assert [line["request_id"] for line in lines] == ["r1", "r2"]
    ok, bad = lines
    assert (ok["status"], ok["error"], ok["device"], ok["batch_id"]) == (200, None, "sim:0", 1)
    assert {"queue_ms", "compute_ms", "latency_ms", "tenant"} <= ok.keys()
    assert (bad["status"], bad["error"]) == (400, "INVALID_INPUT")
    assert "secret" not in caplog.text
    assert "terces" not in caplog.text


@pytest.mark.parametrize(
    ("path", "route", "body"),
    [
        ("/api/inference", "inference", b'{"input": "gone"}'),
        (
            "/v2/models/default/infer",
            "oip",
            b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["gone"]}]}',
        ),
    ],
)
async def test_a_batch_client_that_leaves_is_logged_and_counted_499(
    start_server, gated, caplog, path, route, body
):
    """As a generation whose client leaves: one access-log line and a 499 in the metrics."""
    caplog.set_level(logging.INFO, logger="batchserve.access")
    client, engine = await start_server(gated, access_log=True)
    _, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(raw_http.post(path, body, b"X-Request-Id: left"))
    await gated.entered("sim:0")
    writer.close()
    await writer.wait_closed()
    await until(lambda: not engine.stats().pending)  # the server learns of it on its loop
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == "batchserve.access"]
    assert (line["route"], line["request_id"]) == (route, "left")
    assert (line["status"], line["error"]) == (499, "CLIENT_CLOSED")
    scraped = await (await client.get("/metrics")).text()
    [family] = [
        f for f in text_string_to_metric_families(scraped) if f.name == "batchserve_requests"
    ]
    left = [s for s in family.samples if s.labels["code"] == "499" and s.labels["route"] == route]
    assert [(s.labels["error"], s.value) for s in left] == [("CLIENT_CLOSED", 1.0)]
    gated.gate.set()


def test_recent_window_percentiles_and_throughput():
    window = RecentWindow()
    window.add(5.0, 9.0, Result("x", 0.0, 0.1, 4, 1, "sim:0"))  # older than the window
    for n in range(100):
        window.add(10.0, (n + 1) / 1000, Result("x", 0.0, 0.1, 4, 1, "sim:0"))
    summary = window_numbers(window.columns(now=10.5))
    assert summary["throughput_rps"] == 50.0
    assert summary["p50_ms"] == pytest.approx(51.0)
    assert summary["p99_ms"] == pytest.approx(100.0)
    assert summary["mean_batch"] == 4


def test_recent_window_forgets_old_answers_without_being_read():
    # Only the dashboard reads the window: a server nobody watches must not keep a row for
    # every answer it ever gave.
    window = RecentWindow()
    for n in range(1000):
        window.add(n / 8, 0.001, Result("x", 0.0, 0.1, 4, 1, "sim:0"))  # 8 a second
    assert len(window) <= 8 * 2 * WINDOW_S + 1  # at most two windows' worth between reads
    summary = window_numbers(window.columns(now=999 / 8))
    assert summary["throughput_rps"] == (8 * WINDOW_S + 1) / WINDOW_S


def test_busy_ratio_counts_the_last_window_and_the_running_call():
    device = Device("sim:0", thread=None)  # type: ignore[arg-type]
    device.call_ended(0.0, 1.0)
    device.call_ended(5.0, 6.0)
    device.busy_since = 9.0
    assert device.busy_ratio(now=10.0) == pytest.approx((1.0 + 1.0 + 1.0) / BUSY_WINDOW_S)
    assert device.busy_ratio(now=15.5) == pytest.approx((0.5 + 6.5) / BUSY_WINDOW_S)


def test_busy_ratio_kept_as_a_running_sum_matches_a_walk_of_the_window():
    # The ratio is a running sum (a scrape 20 times a second must not walk the window): at
    # every read it must be what summing the window's calls gives.
    device = Device("sim:0", thread=None)  # type: ignore[arg-type]
    rng = random.Random(7)
    now = 0.0
    for _ in range(2000):
        started = now + rng.choice([0.0, rng.uniform(0, 0.3), rng.uniform(0, 12)])
        now = started + rng.uniform(0.001, rng.choice([0.1, 3.0]))
        device.call_ended(started, now)
        read_at = now + rng.choice([0.0, rng.uniform(0, 0.5)])
        since = read_at - BUSY_WINDOW_S
        walked = sum(end - max(start, since) for start, end in device.recent_calls if end > since)
        assert device.busy_ratio(read_at) == pytest.approx(min(1.0, walked / BUSY_WINDOW_S))
        assert device.recent_busy_s >= -1e-9
    assert len(device.recent_calls) < 2000


def test_busy_window_forgets_old_calls_without_being_read():
    # The ratio is read by a scrape, which may never come: the window must not keep every
    # call the device ever ran.
    device = Device("sim:0", thread=None)  # type: ignore[arg-type]
    for n in range(1000):
        device.call_ended(n * 0.5, n * 0.5 + 0.25)  # a call every half second
    assert len(device.recent_calls) == 2 * BUSY_WINDOW_S
    assert device.busy_total_s == 250.0


def test_desired_replicas_follow_arrivals_against_measured_capacity():
    assert desired_replicas(0.0, None) == 1
    assert desired_replicas(700.0, 1000.0) == 1
    assert desired_replicas(701.0, 1000.0) == 2
    assert desired_replicas(2800.0, 1000.0) == 4


def test_loop_histograms_expose_what_a_prometheus_histogram_would():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from batchserve.observability.loop_metrics import LoopHistograms
    from batchserve.observability.metrics import LATENCY_BUCKETS

    values = [0.0, 0.005, 0.0051, 0.1, 0.12, 3.0, 10.0, 11.0, 0.3]
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("h", "doc", ["model"], buckets=LATENCY_BUCKETS, registry=theirs)
    loop = LoopHistograms("h", "doc", ["model"], LATENCY_BUCKETS)
    ours.register(loop)
    for n, value in enumerate(values):
        reference.labels(f"m{n % 2}").observe(value)
        loop.observe(loop.child(f"m{n % 2}"), value)
    for value in values:  # a batch's values at once, and one value a batch's size over
        reference.labels("m2").observe(value)
        reference.labels("m3").observe(0.12)
    loop.observe_each(loop.child("m2"), values)
    loop.observe(loop.child("m3"), 0.12, times=len(values))

    def samples(registry: CollectorRegistry) -> list[str]:
        lines = generate_latest(registry).decode().splitlines()
        return [line for line in lines if "h_created" not in line]

    assert samples(ours) == samples(theirs)
