"""Traces (observability/tracing.py) as OpenTelemetry's SDK records them, in memory.

Each answered request's span links once, to the span of the batch call that answered it,
whose size counts it; a request a failed batch carried links only to the rescue that
answered it; every span that starts ends, drained or not; with tracing off nothing of
OpenTelemetry is even imported. One test runs the real server with --trace against an OTLP
receiver of its own.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, get_args

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.context import Context
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from batchserve import Config, Engine
from batchserve.clock import FakeClock
from batchserve.config import POISON_MARKER
from batchserve.engine.requests import Caller, Prompt
from batchserve.errors import DeadlineExceeded, InvalidInput
from batchserve.observability import otlp_flush
from batchserve.observability.tracing import FLUSH_TIMEOUT_S, otlp_provider
from batchserve.rules.policy import FlushReason
from batchserve.rules.tenants import Tenant
from batchserve.server import create_app

from .conftest import HANG_GUARD_S, ROOT, BatchserveTestServer, GatedBackend, reach, real_server


class Ends(SpanProcessor):
    """Counts the spans started and ended: a span left open shows as a difference."""

    def __init__(self) -> None:
        self.started: set[int] = set()
        self.ended: set[int] = set()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.started.add(span.context.span_id)

    def on_end(self, span: ReadableSpan) -> None:
        assert span.context is not None
        self.ended.add(span.context.span_id)


class Traced:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.ends = Ends()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.provider.add_span_processor(self.ends)

    def spans(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == f"batchserve.{name}"]


@pytest.fixture
def traced() -> Traced:
    return Traced()


@asynccontextmanager
async def running(
    traced: Traced, gated: GatedBackend, devices: int = 3, **settings: object
) -> AsyncIterator[Engine]:
    config = Config(trace=True, **settings)  # type: ignore[arg-type]
    engine = Engine(
        config,
        fn_per_device=gated,
        devices=f"sim:{devices}",
        clock=FakeClock(),
        tracer_provider=traced.provider,
    )
    async with engine:
        yield engine
    assert traced.ends.started == traced.ends.ended  # drained: no span left open


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def links_by_batch(
    requests: Sequence[ReadableSpan], batches: Sequence[ReadableSpan]
) -> dict[int, list[ReadableSpan]]:
    """Each batch span's id -> the request spans linking to it; every link must point at
    one of `batches`."""
    by_id = {span.context.span_id: span for span in batches if span.context is not None}
    linking: dict[int, list[ReadableSpan]] = {}
    for request in requests:
        for link in request.links:
            assert link.context.span_id in by_id, "a link to a batch span nobody exported"
            assert link.context.trace_id == by_id[link.context.span_id].context.trace_id  # type: ignore[union-attr]
            linking.setdefault(link.context.span_id, []).append(request)
    return linking


async def test_every_answered_request_links_once_to_the_batch_span_that_counts_it(traced, gated):
    gated.gate.set()
    alice = Tenant(name="alice", tier="paid", weight=1.0)
    async with running(traced, gated, max_batch_size=32) as engine:
        results = await asyncio.gather(
            *(
                engine.infer(
                    f"in-{n}", Caller(request_id=f"id-{n}", tenant=alice if n % 2 else None)
                )
                for n in range(400)
            )
        )
    requests, batches = traced.spans("request"), traced.spans("batch")
    assert len(requests) == 400
    assert all(len(span.links) == 1 for span in requests)
    linking = links_by_batch(requests, batches)
    assert sorted(linking) == sorted(b.context.span_id for b in batches if b.context)
    for batch in batches:
        assert batch.context is not None
        size = len(linking[batch.context.span_id])
        assert attrs(batch)["batchserve.batch_size"] == attrs(batch)["batchserve.answered"] == size
        assert batch.status.status_code is StatusCode.UNSET
    assert sum(attrs(b)["batchserve.batch_size"] for b in batches) == 400
    reasons = Counter(attrs(b)["batchserve.flush_reason"] for b in batches)
    assert set(reasons) <= set(get_args(FlushReason))
    assert reasons["full"] > 0  # 400 at once, batches of 32
    assert len(batches) == len({attrs(b)["batchserve.batch_id"] for b in batches})
    by_id = {attrs(span)["batchserve.request_id"]: span for span in requests}
    for n, result in enumerate(results):
        span = by_id[f"id-{n}"]
        got = attrs(span)
        assert got["batchserve.status"] == 200
        assert (got["batchserve.model"], got["batchserve.version"]) == ("default", "1")
        assert got["batchserve.route"] == "inference"
        assert got.get("batchserve.tenant") == ("alice" if n % 2 else None)
        (batch,) = [b for b in batches if b.context.span_id == span.links[0].context.span_id]  # type: ignore[union-attr]
        assert attrs(batch)["batchserve.batch_id"] == result.batch_id
        assert attrs(batch)["batchserve.device"] == result.device
        assert [event.name for event in span.events] == ["batch.start", "batch.end"]
        assert span.start_time is not None
        assert span.end_time is not None
        assert span.start_time <= span.events[0].timestamp <= span.events[1].timestamp
        assert span.events[1].timestamp <= span.end_time


async def test_a_request_a_failed_batch_carried_links_only_to_the_rescue_that_answered_it(
    traced, gated
):
    gated.gate.set()
    texts = [f"in-{n}" for n in range(12)] + [f"bad {POISON_MARKER}"]
    async with running(traced, gated, devices=1) as engine:
        outcomes = await asyncio.gather(
            *(engine.infer(text, Caller(request_id=text)) for text in texts), return_exceptions=True
        )
    assert sum(isinstance(outcome, Exception) for outcome in outcomes) == 1
    requests, batches = traced.spans("request"), traced.spans("batch")
    failed = [b for b in batches if b.status.status_code is StatusCode.ERROR]
    assert failed
    assert all(b.status.description == "ValueError" for b in failed)
    assert all(attrs(b)["batchserve.answered"] == 0 for b in failed)
    linking = links_by_batch(requests, batches)
    assert not any(b.context is not None and b.context.span_id in linking for b in failed)
    rescued = [s for s in requests if attrs(s).get("batchserve.failed_calls", 0) > 0]
    answered = [s for s in rescued if attrs(s)["batchserve.status"] == 200]
    assert answered  # innocents that rode the failed batch, answered by a rescue
    by_id = {b.context.span_id: b for b in batches if b.context is not None}
    for span in answered:
        (link,) = span.links
        assert attrs(by_id[link.context.span_id])["batchserve.flush_reason"] == "rescue"
    (poison,) = [s for s in requests if POISON_MARKER in attrs(s)["batchserve.request_id"]]
    assert (attrs(poison)["batchserve.status"], poison.links) == (500, ())
    assert poison.status.status_code is StatusCode.ERROR
    for batch in batches:  # each batch's answered count is the links to it
        assert batch.context is not None
        assert attrs(batch)["batchserve.answered"] == len(linking.get(batch.context.span_id, []))


async def test_a_request_its_deadline_answered_has_no_link_and_its_batch_counts_no_answer(
    traced, gated
):
    async with running(traced, gated, devices=1, timeout_ms=30) as engine:
        clock = engine.clock
        assert isinstance(clock, FakeClock)
        held = asyncio.ensure_future(engine.infer("held"))
        await reach(engine, lambda s: s.in_flight == 1)
        clock.advance(0.030)
        with pytest.raises(DeadlineExceeded):
            await held
        gated.gate.set()
        await reach(engine, lambda s: s.free_devices == 1)
    (request,) = traced.spans("request")
    (batch,) = traced.spans("batch")
    assert (attrs(request)["batchserve.status"], attrs(request)["batchserve.error"]) == (
        504,
        "DEADLINE_EXCEEDED",
    )
    assert request.links == ()
    assert (attrs(batch)["batchserve.batch_size"], attrs(batch)["batchserve.answered"]) == (1, 0)


async def test_a_generation_has_a_span_and_a_refused_one_none(traced):
    config = Config(
        trace=True, generator="sim", devices="sim:1", sim_step_ms=(0.0, 0.0), timeout_ms=1000
    )
    async with Engine(config, tracer_provider=traced.provider) as engine:
        async with engine.generate(Prompt("abcdef", max_tokens=4), Caller(request_id="g-1")) as gen:
            assert await gen.result() == "fedc"
        with pytest.raises(InvalidInput):
            async with engine.generate(Prompt("abc", max_tokens=0)):
                pass
    assert traced.ends.started == traced.ends.ended
    (span,) = traced.spans("generation")
    got = attrs(span)
    assert got["batchserve.request_id"] == "g-1"
    assert (got["batchserve.status"], got["batchserve.finish_reason"]) == (200, "length")
    assert (got["batchserve.prompt_tokens"], got["batchserve.tokens"]) == (6, 4)
    assert got["batchserve.device"] == "sim:0"
    assert [event.name for event in span.events] == ["first_token"]


async def test_a_tensor_of_inputs_has_a_request_span_per_input(traced, aiohttp_client):
    config = Config(trace=True, devices="sim:2", sim_latency_ms=0)
    engine = Engine(config, tracer_provider=traced.provider)
    client = await aiohttp_client(BatchserveTestServer(create_app(engine)))
    tensor = {"name": "input", "shape": [3], "datatype": "BYTES", "data": ["a", "b", "c"]}
    answer = await client.post("/v2/models/default/infer", json={"inputs": [tensor]})
    assert answer.status == 200, await answer.text()
    requests = traced.spans("request")
    assert len(requests) == 3
    assert {attrs(s)["batchserve.route"] for s in requests} == {"oip"}
    assert all(len(s.links) == 1 for s in requests)


def test_with_tracing_off_opentelemetry_is_never_imported():
    code = (
        "import asyncio, sys\n"
        "import batchserve, batchserve.cli, batchserve.server\n"
        "from batchserve import Config, Engine\n"
        "async def main():\n"
        "    async with Engine(Config(devices='sim:1', sim_latency_ms=0)) as engine:\n"
        "        assert engine._tracer is None\n"
        "        await engine.infer('x')\n"
        "asyncio.run(main())\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_the_otlp_provider_names_the_service_unless_the_environment_does(monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    provider = otlp_provider()
    assert provider.resource.attributes["service.name"] == "batchserve"
    provider.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "inference-eu")
    provider = otlp_provider()
    assert provider.resource.attributes["service.name"] == "inference-eu"
    provider.shutdown()


class UnreachableCollector(SpanExporter):
    """An exporter whose collector never answers: each export blocks until `release`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait()
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.release.set()


def test_the_final_flush_waits_at_most_its_bound_for_a_collector_that_never_answers(
    monkeypatch, caplog
):
    """The exit's flush (main() shuts the provider down) hands its bound to the wait for the
    SDK's shutdown, which a stuck export would otherwise hold 30 s; the wait here returns
    at once, as it would once the bound had passed: no real waiting."""
    bounds: list[float | None] = []

    class BoundPassed(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            bounds.append(timeout)
            return super().wait(0)

    monkeypatch.setattr(otlp_flush, "Event", BoundPassed)
    collector = UnreachableCollector()
    provider = otlp_provider(collector)
    with provider.get_tracer("test").start_as_current_span("left"):
        pass  # queued in the batch processor, to be sent by the final flush
    try:
        provider.shutdown()
        assert bounds == [FLUSH_TIMEOUT_S] == [10.0]  # the documented bound
        assert collector.entered.wait(HANG_GUARD_S)  # the flush is trying to send it
        assert "did not take the last spans within 10 s" in caplog.text
        provider.shutdown()  # again at interpreter exit: nothing more to wait for
        assert bounds == [10.0]
    finally:
        collector.release.set()


async def test_the_real_server_with_trace_on_sends_its_spans_by_otlp_when_it_drains():
    """`--trace on` with OTEL_EXPORTER_OTLP_ENDPOINT pointing at a receiver of the test's
    own: what the server sends, in OTLP/HTTP protobuf, once SIGTERM's drain is over."""
    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        received.append(ExportTraceServiceRequest.FromString(await request.read()))
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_SERVICE_NAME": "batchserve-test",
    }
    try:
        async with real_server(
            "--trace", "on", "--devices", "sim:2", "--sim-latency-ms", "1", env=env
        ) as (process, _, url):
            async with aiohttp.ClientSession(url) as session:
                answers = await asyncio.gather(
                    *(session.post("/api/inference", json={"input": f"x{n}"}) for n in range(20))
                )
                assert [a.status for a in answers] == [200] * 20
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), HANG_GUARD_S) == 0
    finally:
        await runner.cleanup()
    spans = [
        (resource.resource, span)
        for export in received
        for resource in export.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    names = Counter(span.name for _, span in spans)
    assert names["batchserve.request"] == 20
    batch_ids = {span.span_id for _, span in spans if span.name == "batchserve.batch"}
    linked = [span for _, span in spans if span.name == "batchserve.request"]
    assert all(len(s.links) == 1 and s.links[0].span_id in batch_ids for s in linked)
    services = {
        attribute.value.string_value
        for resource, _ in spans
        for attribute in resource.attributes
        if attribute.key == "service.name"
    }
    assert services == {"batchserve-test"}
