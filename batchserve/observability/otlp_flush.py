"""The span processor of `--trace on`: OpenTelemetry's batch processor, with a final flush
that ends within a bound.

The SDK's own shutdown waits up to 30 s for its export thread, and that thread sends each
batch left with retries for up to the exporter's timeout (10 s) apiece: with a collector
that cannot be reached, SIGTERM's exit took about 28 s against the documented 10 s. Imported
only when tracing is on (it imports the SDK).
"""

from __future__ import annotations

import logging
from threading import Event, Thread

from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

log = logging.getLogger(__name__)


class BoundedFlush(BatchSpanProcessor):
    """Sends spans in batches from a thread of its own; its shutdown (the final flush, at
    exit) waits at most `timeout_s` for what is left to be sent, then drops the rest."""

    def __init__(self, exporter: SpanExporter, timeout_s: float) -> None:
        super().__init__(exporter)
        self.timeout_s = timeout_s
        self._closed = False

    def shutdown(self) -> None:
        """The SDK's shutdown, on a daemon thread that the process does not wait for past
        `timeout_s` (an export stuck on the network cannot hold the exit)."""
        if self._closed:  # again at interpreter exit (the provider's atexit hook)
            return
        self._closed = True
        flushed = Event()

        def flush() -> None:
            try:
                BatchSpanProcessor.shutdown(self)  # type: ignore[no-untyped-call]
            finally:
                flushed.set()

        Thread(target=flush, name="batchserve-trace-flush", daemon=True).start()
        if not flushed.wait(self.timeout_s):
            log.warning(
                "traces: the collector did not take the last spans within %g s; they are dropped",
                self.timeout_s,
            )
