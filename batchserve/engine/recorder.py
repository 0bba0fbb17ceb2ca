"""Each answer, counted once: in the metrics and, when asked for, as one access-log line.

The engine records what it answers (library calls and HTTP ones alike); a door records what
it refuses before the engine sees the request (a body that is not JSON, a missing key).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from ..batching.request import Result
from ..errors import BatchserveError, ClientClosed
from ..generation.request import Generation
from ..observability.metrics import NO_TIER, Metrics
from ..rules.tenants import Tenant

access_log = logging.getLogger("batchserve.access")


class Recorder:
    def __init__(self, metrics: Metrics | None, access_log_on: bool) -> None:
        self._metrics = metrics
        self.access_log_on = access_log_on
        """Whether each answer is logged; a live reconfigure changes it."""

    def record(
        self,
        route: str,
        request_id: str,
        tenant: Tenant | None,
        latency_s: float,
        outcome: Result | BatchserveError,
        now: float,
    ) -> None:
        tier = NO_TIER if tenant is None else tenant.tier
        if isinstance(outcome, Result):
            status, code = 200, None
            if self._metrics is not None:
                self._metrics.ok(route, tier, now, latency_s, outcome)
        else:
            status, code = outcome.status, outcome.code
            if self._metrics is not None:
                self._metrics.failed(route, tier, status, code)
        if self.access_log_on:
            access_log.info(
                _access_line(route, request_id, tenant, status, code, latency_s, outcome)
            )

    def record_generation(
        self, route: str, tenant: Tenant | None, gen: Generation, now: float
    ) -> None:
        """A generation accepted and now over: ended by itself, failed, or left."""
        error = _generation_outcome(gen)
        if error is not None:
            self.record(route, gen.request_id, tenant, now - gen.arrival, error, now)
            return
        if self._metrics is not None:
            tier = NO_TIER if tenant is None else tenant.tier
            self._metrics.generated(route, tier, now, gen)
        if self.access_log_on:
            line = _access_line(route, gen.request_id, tenant, 200, None, now - gen.arrival, gen)
            access_log.info(line)


def _generation_outcome(gen: Generation) -> BatchserveError | None:
    """How a generation's answer counts: its error; None when it ended by itself."""
    if gen.error is not None:
        return gen.error
    if gen.finish_reason is None:
        return ClientClosed("the client left before the generation ended")
    return None


def _access_line(
    route: str,
    request_id: str,
    tenant: Tenant | None,
    status: int,
    code: str | None,
    latency_s: float,
    outcome: Result | BatchserveError | Generation,
) -> str:
    """One JSON object: who, what status, where the time went. Never the input text.

    Its `ts` is wall-clock time, for people and log stores; durations come from the engine's
    clock."""
    line: dict[str, Any] = {
        "ts": round(time.time(), 3),
        "route": route,
        "request_id": request_id,
        "tenant": None if tenant is None else tenant.name,
        "status": status,
        "error": code,
        "latency_ms": round(latency_s * 1e3, 3),
    }
    if isinstance(outcome, Result):
        line |= {
            "queue_ms": round(outcome.queue_s * 1e3, 3),
            "compute_ms": round(outcome.compute_s * 1e3, 3),
            "batch_id": outcome.batch_id,
            "batch_size": outcome.batch_size,
            "device": outcome.device,
        }
    elif isinstance(outcome, Generation):
        summary = outcome.summary()
        line |= {
            "ttft_ms": summary["ttft_ms"],
            "tokens": summary["tokens"],
            "prompt_tokens": summary["prompt_tokens"],
            "finish_reason": summary["finish_reason"],
            "preemptions": outcome.preemptions,
            "device": outcome.device,
        }
    return orjson.dumps(line).decode()
