"""What operators watch: Prometheus metrics for /metrics and live numbers for the dashboard.

Per answered request the handler pays one counter increment, one histogram observation
(children bound once; `loop_metrics.py`, lock-free on the loop) and one append to a short
window; queue wait and compute are observed once per successful batch call. Everything else
(queue depth, devices' busy ratio and health, capacity, the autoscaling signal) is read from
the batcher and the pool when scraped, so it costs the hot path nothing.

Over 400 lines because every family the operators and the gateway read is declared here,
with its help text, next to the snapshot it is written from.
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from ..batcher import Batcher
from ..batching.request import QueuedRequest, Result
from ..batching.snapshot import BatcherSnapshot
from ..clock import Clock
from ..devices.fleet import PoolStats
from ..devices.health import HEALTHY, DeviceState
from ..generation.models import Generators
from ..generation.request import Generation
from ..gpu_pool import GpuPool
from ..models.registry import Registry
from .exposition import Child, FamilyText, Gauges, HistogramText, Scrape, TextCollector
from .generation_metrics import GenerationCollector
from .loop_metrics import LoopCount, LoopCounters, LoopHistogram, LoopHistograms
from .picker import PickerCollector
from .window import ROW, RecentWindow, keep_recent, percentile_ms, window_numbers

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.0, 5.0, 10.0,
)  # fmt: skip
TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100)
TARGET_UTILIZATION = 0.7
"""The desired-replicas signal sizes the fleet so that each replica runs at this share of its
measured capacity: headroom for bursts, and for the batching policy to stagger devices."""
NO_TIER = "none"
"""The tier label until API keys exist."""
REJECTIONS = frozenset({"OVERLOADED", "NOT_READY", "RATE_LIMITED"})


class BatchTimes:
    """The histograms fed once for each batch call that succeeded: built before the batcher,
    which is handed `ran` (the rest of the metrics read the batcher, so come after it)."""

    def __init__(self) -> None:
        self.queue_wait = LoopHistograms(
            "batchserve_queue_wait_seconds",
            "Arrival to the start of the batch call, for each request of a call that succeeded.",
            [],
            LATENCY_BUCKETS,
        )
        self.compute = LoopHistograms(
            "batchserve_compute_seconds",
            "Duration of the batch call, once for each request of a call that succeeded.",
            [],
            LATENCY_BUCKETS,
        )
        self._queue_wait_all, self._compute_all = self.queue_wait.child(), self.compute.child()

    def ran(self, batch: list[QueuedRequest], started: float, finished: float) -> None:
        """Each request's queue wait and the call's duration: observed once a batch rather
        than twice an answer."""
        self.queue_wait.observe_each(self._queue_wait_all, [started - r.arrival for r in batch])
        self.compute.observe(self._compute_all, finished - started, len(batch))


class Metrics:
    def __init__(
        self,
        batch_times: BatchTimes,
        batcher: Batcher,
        pool: GpuPool,
        registry: Registry,
        generators: Generators,
        *,
        clock: Clock,
        slo_s: float,
    ) -> None:
        self._clock = clock
        self._versions = registry
        self.registry = CollectorRegistry()
        self._requests = LoopCounters(
            "batchserve_requests",
            "Requests answered, by route, HTTP status, tier, error code, and model and version"
            " (of 200s; empty for errors, which may name no model).",
            ["route", "code", "tier", "error", "model", "version"],
        )
        self._rejections = Counter(
            "batchserve_rejections",
            "Requests refused before they were queued, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self._latency = LoopHistograms(
            "batchserve_request_latency_seconds",
            "Arrival to answer, for requests answered 200, by model and version.",
            ["model", "version"],
            LATENCY_BUCKETS,
        )
        for family in (self._requests, self._latency, batch_times.queue_wait, batch_times.compute):
            self.registry.register(family)
        self._ttft = Histogram(
            "batchserve_time_to_first_token_seconds",
            "Arrival to the first token, for generations that made one, by model and version.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._tpot = Histogram(
            "batchserve_time_per_output_token_seconds",
            "After the first token, each generation's mean time per further token.",
            ["model", "version"],
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self._generated = Counter(
            "batchserve_generated_tokens",
            "Tokens generated for answered generations, by model and version.",
            ["model", "version"],
            registry=self.registry,
        )
        self._answered: dict[
            tuple[str, str, str, str], tuple[LoopCount, LoopHistogram, RecentWindow]
        ] = {}
        """Per route, tier, model and version, its counter and latency children and its
        version's window: bound once, since finding them costs more than counting. Every key
        is the server's own (routes, tiers, registered models), so this stays small."""
        self._windows: dict[str, RecentWindow] = {}
        """Each model version's recent answers, by its label (model@version)."""
        # The picker's gauges are written by their own collector, the one `live` one: a
        # /metrics scrape writes them afresh while it may reuse the rest (exposition.py).
        picker = PickerCollector(batcher, pool, generators, clock)
        self.registry.register(picker)
        self._state = _StateCollector(batcher, pool, registry, clock, slo_s)
        self.registry.register(self._state)
        self._generation_state = GenerationCollector(generators, clock)
        self.registry.register(self._generation_state)
        self.picker_registry = CollectorRegistry(auto_describe=False)
        """The gateway picker's gauges alone, for /metrics/picker (the same collector as in
        `registry`)."""
        self.picker_registry.register(picker)
        self._first_tokens: deque[tuple[float, float, str]] = deque()
        """(time, time to first token, model label) of recent generations, for the page."""

    def ok(self, route: str, tier: str, now: float, latency_s: float, result: Result) -> None:
        key = (route, tier, result.model, result.version)
        children = self._answered.get(key)
        if children is None:
            if self._versions.get(result.model, result.version) is None:
                return  # answered after its version was removed: its series are gone
            label = f"{result.model}@{result.version}"
            children = self._answered[key] = (
                self._requests.child(route, "200", tier, "", result.model, result.version),
                self._latency.child(result.model, result.version),
                self._windows.setdefault(label, RecentWindow()),
            )
        children[0].value += 1
        self._latency.observe(children[1], latency_s)
        children[2].add(now, latency_s, result)

    def forget(self, model: str, version: str) -> None:
        """Removes every series of a model version that was removed (and what the dashboard
        keeps of it), so that versions added and deleted over time do not grow the scrape."""
        self._requests.remove_where(lambda values: values[4:] == (model, version))
        self._latency.remove_where(lambda values: values == (model, version))
        for key in [key for key in self._answered if key[2:] == (model, version)]:
            del self._answered[key]
        self._windows.pop(f"{model}@{version}", None)
        for family in (self._ttft, self._tpot, self._generated):
            family.remove(model, version)  # nothing to remove is not an error

    def generated(self, route: str, tier: str, now: float, gen: Generation) -> None:
        """A generation that ended by itself (stop or length); per generation, not per token."""
        self._requests.child(route, "200", tier, "", gen.model, gen.version).value += 1
        self._latency.observe(self._latency.child(gen.model, gen.version), now - gen.arrival)
        tokens = len(gen.seq.tokens)
        self._generated.labels(gen.model, gen.version).inc(tokens)
        first = gen.first_token_at
        if first is not None:
            self._ttft.labels(gen.model, gen.version).observe(first - gen.arrival)
            self._first_tokens.append((now, first - gen.arrival, f"{gen.model}@{gen.version}"))
            keep_recent(self._first_tokens, now)
            if tokens > 1:
                self._tpot.labels(gen.model, gen.version).observe((now - first) / (tokens - 1))

    def failed(self, route: str, tier: str, status: int, code: str) -> None:
        self._requests.child(route, str(status), tier, code, "", "").value += 1
        if code in REJECTIONS:
            self._rejections.labels(code).inc()

    def snapshot(self) -> dict[str, Any]:
        """The dashboard's numbers: the last WINDOW_S of answers and the state right now,
        for all and for each model version. `time` is wall-clock, for the time axis."""
        now = self._clock.time()
        answered = {label: window.columns(now) for label, window in self._windows.items()}
        everything = [
            list(itertools.chain.from_iterable(columns[field] for columns in answered.values()))
            for field in range(ROW)
        ]
        state = self._state.summary(now)
        for row in state["models"]:
            row.update(window_numbers(answered.get(row["label"], [()] * ROW)))
        keep_recent(self._first_tokens, now)
        generation = self._generation_state.summary(now)
        for row in generation:
            ttfts = tuple(t for _, t, label in self._first_tokens if label == row["label"])
            row["ttft_p50_ms"] = percentile_ms(ttfts, 0.50)
            row["ttft_p99_ms"] = percentile_ms(ttfts, 0.99)
        return {
            "time": time.time(),
            **window_numbers(everything),
            **state,
            "generation": generation,
        }


class _StateCollector(TextCollector):
    """Reads the batcher's and the pool's snapshots at scrape time."""

    def __init__(
        self,
        batcher: Batcher,
        pool: GpuPool,
        registry: Registry,
        clock: Clock,
        slo_s: float,
    ) -> None:
        self._batcher = batcher
        self._registry = registry
        self._pool = pool
        self._clock = clock
        self._slo_s = slo_s
        self._device_writers = _device_writers()
        self._batch_size = HistogramText(
            "batchserve_batch_size", "Requests per batch call, retries included.", (),
            _BATCH_BOUNDS,
        )  # fmt: skip
        self._count_writers = _count_writers()

    def summary(self, now: float) -> dict[str, Any]:
        return self._summary(now, self._batcher.snapshot(now), self._pool.stats(now))

    def _summary(self, now: float, batcher: BatcherSnapshot, pool: PoolStats) -> dict[str, Any]:
        return {
            "queued": batcher.queued,
            "in_flight": batcher.in_flight,
            "healthy_devices": batcher.healthy_devices,
            "capacity_rps": batcher.capacity_rps,
            "arrival_rps": batcher.arrival_rps,
            "predicted_wait_s": batcher.predicted_wait_s,
            "slo_s": self._slo_s,
            "desired_replicas": desired_replicas(batcher.arrival_rps, batcher.capacity_rps),
            "batch_sizes": {str(size): n for size, n in sorted(batcher.batch_sizes.items())},
            "batch_api": batcher.idle._asdict(),
            "models": [
                {
                    "label": version.spec.label,
                    "model": version.name,
                    "version": version.version,
                    "state": version.state.value,
                    "devices": version.loaded_on,
                    "queued": batcher.queued_by_version.get((version.name, version.version), 0),
                    "arrival_rps": version.arrivals.at(now),
                    "device_seconds_per_s": version.device_time.at(now),
                    "batches": batcher.batch_fill.get(
                        (version.name, version.version, "batches"), 0
                    ),
                }
                for version in self._registry
            ],
            "devices": [
                {
                    "name": device.name,
                    "state": device.state.value,
                    "busy_ratio": device.busy_ratio,
                    "busy_seconds": device.busy_seconds,
                }
                for device in pool.devices
            ],
        }

    def scrape(self, out: Scrape) -> None:
        """The same numbers as `summary`, read from one snapshot of each (the dashboard's
        per-version rows, which no family shows, left out). The picker's gauges are
        `PickerCollector`'s."""
        now = self._clock.time()
        batcher, pool = self._batcher.snapshot(now), self._pool.stats(now)
        devices = pool.devices
        values: list[float | None] = [
            batcher.queued,
            batcher.in_flight,
            sum(device.state is DeviceState.BUSY for device in devices),
            batcher.capacity_rps,
            batcher.arrival_rps,
            batcher.predicted_wait_s,
            self._slo_s,
            desired_replicas(batcher.arrival_rps, batcher.capacity_rps),
        ]
        out.gauges(_STATE_GAUGES, [math.nan if v is None else v for v in values])
        out.gauges(_BATCH_API_GAUGES, list(batcher.idle))
        busy_ratio, busy_seconds, healthy, state = self._device_writers
        out.family(busy_ratio, [((d.name,), d.busy_ratio) for d in devices])
        out.family(busy_seconds, [((d.name,), d.busy_seconds) for d in devices])
        out.family(healthy, [((d.name,), float(d.state in HEALTHY)) for d in devices])
        out.family(state, [((d.name, d.state.value), 1.0) for d in devices])
        out.histogram(self._batch_size, _batch_sizes(batcher.batch_sizes))
        fill, faults, recoveries = self._count_writers
        out.family(fill, sorted(batcher.batch_fill.items()))
        out.family(faults, [((kind,), count) for kind, count in sorted(pool.faults.items())])
        out.family(
            recoveries, [((kind,), count) for kind, count in sorted(batcher.recoveries.items())]
        )


_DESIRED_REPLICAS_HELP = (
    f"Replicas that would carry the recent arrivals at {TARGET_UTILIZATION:.0%} of"
    " this replica's measured capacity."
)
_STATE_GAUGES = Gauges(
    [
        ("batchserve_queue_depth", "Requests waiting for a batch."),
        ("batchserve_in_flight_requests", "Requests inside a batch call."),
        ("batchserve_in_flight_batches", "Batch calls running now."),
        (
            "batchserve_capacity_rps",
            "Requests a second the healthy devices can take in full batches, measured.",
        ),
        ("batchserve_arrival_rps", "Recent arrivals a second."),
        (
            "batchserve_predicted_queue_wait_seconds",
            "How long a request arriving now would wait for the queue ahead of it.",
        ),
        ("batchserve_slo_seconds", "The latency objective (--slo-ms)."),
        ("batchserve_desired_replicas", _DESIRED_REPLICAS_HELP),
    ]
)
"""Shared by every collector: a template holds no state of a scrape."""
_BATCH_API_GAUGES = Gauges(
    [
        ("batchserve_batch_lines_waiting", "Batch API lines waiting for an idle device."),
        ("batchserve_batch_lines_running", "Batch API lines inside a batch call."),
        ("batchserve_batch_lines_done", "Batch API lines answered by a device since start."),
        (
            "batchserve_batch_device_seconds",
            "Device seconds the Batch API's calls took since start: its rate over the devices"
            " is the share of device time batches used.",
        ),
        (
            "batchserve_online_wait_seconds",
            "Seconds since start a free device stood while online requests waited for it (the"
            " batcher's pass, a policy lingering): not idle capacity for Batch API lines.",
        ),
    ]
)
_BATCH_BOUNDS = (*map(str, BATCH_BUCKETS), "+Inf")


def _device_writers() -> tuple[FamilyText, FamilyText, FamilyText, FamilyText]:
    """The gauges of each device, from the pool's snapshot already taken at a scrape."""
    device = ["device"]
    return (
        FamilyText(
            "batchserve_device_busy_ratio",
            "Share of the last 10 s each device spent in batch calls.",
            "gauge",
            device,
        ),
        FamilyText(
            "batchserve_device_busy_seconds",
            "Time each device spent in finished batch calls.",
            "counter",
            device,
        ),
        FamilyText("batchserve_device_healthy", "1 while the device takes work.", "gauge", device),
        FamilyText(
            "batchserve_device_state",
            "1 for each device's current state.",
            "gauge",
            ["device", "state"],
        ),
    )


def _count_writers() -> tuple[FamilyText, FamilyText, FamilyText]:
    return (
        FamilyText(
            "batchserve_batch_fill",
            "Batches sent and requests in them, per model version: requests / batches is its"
            " mean batch size, which falls when traffic spreads over many keys (params,"
            " lengths). Never labelled with params.",
            "counter",
            ["model", "version", "kind"],
        ),
        FamilyText("batchserve_faults", "Device and batch faults, by kind.", "counter", ["kind"]),
        FamilyText(
            "batchserve_recoveries", "Requests retried or failed after a fault.", "counter",
            ["kind"],
        ),
    )  # fmt: skip


def _batch_sizes(sizes: Mapping[int, int]) -> list[Child]:
    counts = [0] * len(_BATCH_BOUNDS)
    for size, count in sizes.items():
        counts[bisect_left(BATCH_BUCKETS, size)] += count  # le bounds are inclusive
    return [((), counts, sum(size * count for size, count in sizes.items()))]


def desired_replicas(arrival_rps: float, capacity_rps: float | None) -> int:
    if not capacity_rps:
        return 1
    return max(1, math.ceil(arrival_rps / (capacity_rps * TARGET_UTILIZATION)))
