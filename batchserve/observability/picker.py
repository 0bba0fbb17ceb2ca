"""The server's load as the Kubernetes inference gateway's endpoint picker reads it: requests
waiting, requests running and a utilisation in [0, 1] (docs/operating.md, "Kubernetes
inference gateway"). The same gauges are in /metrics and, alone, in /metrics/picker: the
picker scrapes every 50 ms, and its few lines cost a fraction of the whole exposition. In
/metrics they are always fresh, while the rest may be reused from a render up to
--metrics-max-age-ms old (exposition.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

from ..batcher import Batcher
from ..clock import Clock
from ..devices.device import Device
from ..devices.health import HEALTHY
from ..generation.models import GenerationStats, Generators
from ..gpu_pool import GpuPool
from .exposition import FamilyText, Gauges, Scrape, TextCollector


class PickerCollector(TextCollector):
    """The picker's gauges alone, from the cheapest reads of the batcher, the pool and the
    generation models (not the snapshots a full scrape takes). The one `live` collector:
    /metrics writes it at every scrape, and may reuse the rest for --metrics-max-age-ms."""

    live = True

    def __init__(
        self, batcher: Batcher, pool: GpuPool, generators: Generators, clock: Clock
    ) -> None:
        self._batcher = batcher
        self._pool = pool
        self._generators = generators
        self._clock = clock
        self._started = time.time()
        self._families = PickerFamilies()

    def scrape(self, out: Scrape) -> None:
        now = self._clock.time()
        batcher = self._batcher.stats()
        generation = [model.stats(now) for model in self._generators]
        slots = batch_slots(self._pool.devices)
        load = picker_load(batcher.queued, batcher.in_flight, slots, generation)
        self._families.scrape(out, load, self._started)


def batch_slots(devices: Iterable[Device]) -> int:
    """Requests the healthy devices take in one call each: per device, the largest max batch
    size of the versions loaded there (read every 50 ms)."""
    return sum(
        max((v.spec.max_batch_size for v in d.fns), default=0)
        for d in devices
        if d.state in HEALTHY
    )


_PICKER_GAUGES = (
    (
        ("batchserve_requests_waiting", "vllm:num_requests_waiting"),
        "Requests accepted and not yet in a device call: queued for a batch, or"
        " generations waiting for a place in the steps.",
    ),
    (
        ("batchserve_requests_running", "vllm:num_requests_running"),
        "Requests inside device calls: batch calls running now, and generations in"
        " the steps (at most each device's max batch size).",
    ),
    (
        ("batchserve_utilization", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "0 to 1: the larger of (batch requests waiting and running) / (one full batch"
        " on each healthy device) and, for generation models, the KV-cache budget in"
        " use; 1 when the server holds more work than its devices take at once.",
    ),
)


class PickerFamilies:
    """What the Kubernetes inference gateway's endpoint picker scrapes (its model server
    protocol): requests waiting, requests running and a utilisation in [0, 1], one
    unlabelled series each for the whole server, under batchserve's names and under the
    vLLM names the picker reads by default (docs/operating.md, "Kubernetes inference
    gateway"), so that it routes and sheds on batchserve with no flags of its own."""

    def __init__(self) -> None:
        self._gauges = Gauges([(name, text) for names, text in _PICKER_GAUGES for name in names])
        self._lora = FamilyText(
            "vllm:lora_requests_info",
            "No LoRA adapters (for the inference gateway's picker, which looks for this):"
            " the value is when the server started.",
            "gauge",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )

    def scrape(self, out: Scrape, load: PickerLoad, started: float) -> None:
        values = (load.waiting, load.running, load.utilization)
        out.gauges(
            self._gauges,
            [value for (names, _), value in zip(_PICKER_GAUGES, values, strict=True)
             for _ in names],
        )  # fmt: skip
        out.family(self._lora, [(("0", "", ""), started)])


@dataclasses.dataclass(frozen=True, slots=True)
class PickerLoad:
    waiting: int
    running: int
    utilization: float


def picker_load(
    queued: int, in_flight: int, batch_slots: int, generation: Sequence[GenerationStats]
) -> PickerLoad:
    """The server's load as the endpoint picker reads it. A batch model's utilisation is
    the work it holds over one round of full batches (`batch_slots`): below 1, a request
    arriving now rides in the next call of some device; at 1, it waits behind whole
    batches. A generation model's is its KV-cache budget in use, as vLLM's. The server's is
    the busiest of these, at most 1."""
    batch_work = queued + in_flight
    # With no healthy device, whatever waits is stuck: full.
    shares = [batch_work / batch_slots if batch_slots else float(batch_work > 0)]
    shares += [g.kv_used_tokens / g.kv_budget_tokens for g in generation if g.kv_budget_tokens]
    return PickerLoad(
        waiting=queued + sum(g.waiting for g in generation),
        running=in_flight + sum(g.running for g in generation),
        utilization=min(1.0, max(shares)),
    )
