"""OpenTelemetry traces (the [otel] extra), off by default: a span per request, linked to
the span of the batch call that answered it.

    batchserve.request     arrival -> answered; one per request the engine queued (each
                           input of a list is one)
        attributes         batchserve.request_id, .route, .model, .version, .tenant, .status
                           (the HTTP status), .error (its code), .failed_calls (failed
                           calls it rode first)
        events             batch.start, batch.end: the call that answered it (queue, then
                           compute; its id, device and size are on the batch span)
        link               that call's batch span: exactly one for an answered request,
                           none for one answered otherwise (504, 503, 500, 499)
    batchserve.batch       the call's start -> its return; one per batch call
        attributes         batchserve.batch_id, .device, .model, .version, .batch_size,
                           .answered (the requests it answered, each linking here),
                           .flush_reason (rules/policy.py's FlushReason)
        status             error for a failed call: the type it raised, or "hung"
    batchserve.generation  arrival -> over; one per generation (no links to its steps)
        attributes         as a request's, and .prompt_tokens, .tokens, .finish_reason,
                           .preemptions; event first_token

Spans are made after the fact, from the times the engine measured on its clock, when a
batch call returns and when a request's waiter is done with it: nothing is ever held open,
so a drain, a crash or a wedged call leaves no span unended (a hung call's span comes when
it returns). With tracing off the engine holds no Tracer, and each hook is one `is None`
check; OpenTelemetry is imported only when tracing is on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..batching.request import QueuedRequest, Result
from ..clock import Clock
from ..devices.calls import BatchCall
from ..errors import BatchserveError, ClientClosed, StartupError
from ..generation.request import Generation

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import TracerProvider

SERVICE_NAME = "batchserve"
"""The service name the OTLP exporter reports, unless OTEL_SERVICE_NAME (or
OTEL_RESOURCE_ATTRIBUTES) names another."""
NEEDS_EXTRA = "--trace needs OpenTelemetry: pip install 'batchserve[otel]'"
FLUSH_TIMEOUT_S = 10.0
"""The most the final flush at exit may take: what an unreachable collector can add to the
exit after SIGTERM's drain (docs/operating.md)."""


class Tracer:
    """Turns what the engine measured into spans of `provider`'s (an SDK TracerProvider,
    or any other implementation of the API)."""

    def __init__(self, provider: TracerProvider, clock: Clock) -> None:
        from opentelemetry.trace import Link, Status, StatusCode

        self._tracer = provider.get_tracer("batchserve")
        self._clock = clock
        self._link = Link
        self._status = Status
        self._error = StatusCode.ERROR

    def __repr__(self) -> str:
        return f"<Tracer {self._tracer!r}>"

    def _times(self) -> tuple[float, int]:
        """Now on the engine's clock, and in the wall-clock nanoseconds spans are stamped
        with: an engine time `t` is then `now_ns - (now - t) * 1e9`."""
        return self._clock.time(), time.time_ns()

    def batch_call(self, call: BatchCall) -> None:
        """The span of a batch call that returned (GpuPool.on_call); a call that answered
        its batch becomes the link of each request it answers."""
        now, now_ns = self._times()
        waiting = [r for r in call.batch if not r.future.done()] if call.error is None else []
        version = call.batch[0].key.version
        span = self._tracer.start_span(
            "batchserve.batch",
            start_time=_ns(call.started, now, now_ns),
            attributes={
                "batchserve.batch_id": call.batch_id,
                "batchserve.device": call.device,
                "batchserve.model": version.name,
                "batchserve.version": version.version,
                "batchserve.batch_size": len(call.batch),
                "batchserve.answered": len(waiting),
                "batchserve.flush_reason": call.reason,
            },
        )
        if call.error is not None:
            span.set_status(self._status(self._error, call.error))
        span.end(end_time=_ns(call.finished, now, now_ns))
        context = span.get_span_context()
        for request in waiting:
            request.batch_span = context

    def request(self, route: str, request: QueuedRequest, error: Result | BatchserveError) -> None:
        """The span of a request its waiter is done with (Engine.settle): its result or
        error (ClientClosed for a waiter that left with nothing answered)."""
        now, now_ns = self._times()
        version = request.key.version
        attributes: dict[str, Any] = {
            "batchserve.request_id": request.request_id,
            "batchserve.route": route,
            "batchserve.model": version.name,
            "batchserve.version": version.version,
        }
        if request.tenant:
            attributes["batchserve.tenant"] = request.tenant
        if request.rescue_round:
            attributes["batchserve.failed_calls"] = request.rescue_round
        # The batch's id, device and size are on the span it links to, and its start and end
        # are the events: the SDK checks each attribute, which is most of a span's cost.
        if isinstance(error, Result):
            attributes["batchserve.status"] = 200
        else:
            attributes |= {"batchserve.status": error.status, "batchserve.error": error.code}
        # A request its batch answered links to that batch; one answered otherwise (its
        # deadline, a drain) links to none, even if a batch carried it too.
        linked = request.batch_span is not None and isinstance(error, Result)
        span = self._tracer.start_span(
            "batchserve.request",
            start_time=_ns(request.arrival, now, now_ns),
            attributes=attributes,
            links=[self._link(request.batch_span)] if linked else None,  # type: ignore[arg-type]
        )
        if isinstance(error, Result):
            started = request.arrival + error.queue_s
            span.add_event("batch.start", timestamp=_ns(started, now, now_ns))
            span.add_event("batch.end", timestamp=_ns(started + error.compute_s, now, now_ns))
        elif error.status >= 500:
            span.set_status(self._status(self._error, error.code))
        span.end(end_time=now_ns)

    def generation(self, route: str, gen: Generation) -> None:
        """The span of a generation that is over: ended by itself, failed, or left."""
        now, now_ns = self._times()
        error = gen.error
        if error is None and gen.finish_reason is None:
            error = ClientClosed("")
        attributes: dict[str, Any] = {
            "batchserve.request_id": gen.request_id,
            "batchserve.route": route,
            "batchserve.model": gen.model,
            "batchserve.version": gen.version,
            "batchserve.status": 200 if error is None else error.status,
            "batchserve.prompt_tokens": gen.prompt_tokens,
            "batchserve.tokens": len(gen.seq.tokens),
            "batchserve.preemptions": gen.preemptions,
        }
        if gen.tenant:
            attributes["batchserve.tenant"] = gen.tenant
        if gen.device:
            attributes["batchserve.device"] = gen.device
        if gen.finish_reason is not None:
            attributes["batchserve.finish_reason"] = gen.finish_reason
        if error is not None:
            attributes["batchserve.error"] = error.code
        span = self._tracer.start_span(
            "batchserve.generation",
            start_time=_ns(gen.arrival, now, now_ns),
            attributes=attributes,
        )
        if gen.first_token_at is not None:
            span.add_event("first_token", timestamp=_ns(gen.first_token_at, now, now_ns))
        if error is not None and error.status >= 500:
            span.set_status(self._status(self._error, error.code))
        span.end(end_time=now_ns)


def otlp_provider(
    exporter: SpanExporter | None = None, flush_timeout_s: float = FLUSH_TIMEOUT_S
) -> SdkTracerProvider:
    """An SDK TracerProvider exporting over OTLP/HTTP (protobuf) in batches from a thread of
    its own, configured by the standard variables: OTEL_EXPORTER_OTLP_ENDPOINT (default
    http://localhost:4318) or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_HEADERS,
    OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER and OTEL_BSP_*. Its
    caller (the CLI) shuts it down, which sends what is left for at most `flush_timeout_s`
    (otlp_flush.py). `exporter`: another than OTLP's. StartupError without the [otel]
    extra."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        from .otlp_flush import BoundedFlush
    except ImportError:
        raise StartupError(NEEDS_EXTRA) from None
    resource = Resource.create()  # the variables' attributes
    if str(resource.attributes.get("service.name")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter() if exporter is None else exporter
    provider.add_span_processor(BoundedFlush(exporter, flush_timeout_s))
    return provider


def global_provider() -> TracerProvider:
    """The provider a program embedding the engine installed (opentelemetry.trace's
    global); StartupError without the API."""
    try:
        from opentelemetry import trace
    except ImportError:
        raise StartupError(NEEDS_EXTRA) from None
    return trace.get_tracer_provider()


def _ns(t: float, now: float, now_ns: int) -> int:
    """Engine time `t` as wall-clock nanoseconds, `now` being `now_ns`."""
    return now_ns - round((now - t) * 1e9)
