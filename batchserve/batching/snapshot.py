"""What the batcher reports of itself: counts for the engine's views and drain, and a copy of
its state for the metrics and the dashboard at a scrape."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .idle import IdleCounts


@dataclass(frozen=True, slots=True)
class BatcherStats:
    queued: int
    in_flight: int
    free_devices: int
    healthy_devices: int
    batches: int
    completed: int


@dataclass(frozen=True, slots=True)
class BatcherSnapshot:
    """What the metrics and the dashboard read of the batcher at a scrape: copies, so that a
    reader neither reaches into the batcher nor sees it change under it."""

    queued: int
    """Requests waiting for a batch, those to be retried included."""
    in_flight: int
    healthy_devices: int
    capacity_rps: float | None
    arrival_rps: float
    predicted_wait_s: float
    """How long a request arriving now would wait for the queue ahead of it."""
    queued_by_version: Mapping[tuple[str, str], int]
    """Requests waiting per (model, version), for the versions that have any."""
    batch_sizes: Mapping[int, int]
    batch_fill: Mapping[tuple[str, str, str], int]
    recoveries: Mapping[str, int]
    idle: IdleCounts
    """The Batch API's lines: waiting, running, done, and the device time they used."""
