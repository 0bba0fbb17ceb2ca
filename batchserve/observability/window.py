"""The last few seconds of answers, for the dashboard's live percentiles (Prometheus keeps
buckets; a dashboard wants p50 and p99 of just now)."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from typing import Any

from ..batching.request import Result

WINDOW_S = 2.0

ROW = 5
"""The numbers a window keeps of an answer: time, latency, queue wait, compute, batch size."""


class RecentWindow:
    """A model version's answers of the last WINDOW_S, for live percentiles (Prometheus
    keeps buckets).

    An answer is ROW numbers in a flat array of doubles, not a tuple of objects: a window
    keeps seconds of answers, and each object kept that long after its answer costs the
    loop (benchmarks/README.md, section 4). Rows go in two generations of WINDOW_S each;
    the add that finds the newer one over starts another and drops the older, so a window
    that nobody reads holds at most two windows' worth."""

    def __init__(self) -> None:
        self._older: array[float] = array("d")
        self._newer: array[float] = array("d")
        self._turn_at = -math.inf

    def __len__(self) -> int:
        return (len(self._older) + len(self._newer)) // ROW

    def add(self, now: float, latency_s: float, result: Result) -> None:
        if now >= self._turn_at:
            self._older, self._newer = self._newer, array("d")
            self._turn_at = now + WINDOW_S
        self._newer.extend((now, latency_s, result.queue_s, result.compute_s, result.batch_size))

    def columns(self, now: float) -> list[array[float]]:
        """The answers of the last WINDOW_S: a column for each of an answer's ROW numbers."""
        rows = self._older + self._newer
        first = bisect_left(rows[0::ROW], now - WINDOW_S)  # rows are added in time order
        return [rows[field::ROW][first:] for field in range(ROW)]


def keep_recent(window: deque[Any], now: float) -> None:
    """Drops the rows (time first) older than WINDOW_S. Adds drop them too, not only reads: a
    window that only a dashboard reads would otherwise grow by a row an answer for as long as
    nobody opens the page."""
    cutoff = now - WINDOW_S
    while window and window[0][0] < cutoff:
        window.popleft()


def window_numbers(columns: Sequence[Sequence[float]]) -> dict[str, float | None]:
    """The dashboard's numbers of a window's columns (`RecentWindow.columns`, or several
    windows' joined)."""
    _, latencies, queue_waits, computes, batch_sizes = columns
    return {
        "throughput_rps": len(latencies) / WINDOW_S,
        "p50_ms": percentile_ms(latencies, 0.50),
        "p99_ms": percentile_ms(latencies, 0.99),
        "queue_p50_ms": percentile_ms(queue_waits, 0.50),
        "compute_p50_ms": percentile_ms(computes, 0.50),
        "mean_batch": sum(batch_sizes) / len(batch_sizes) if batch_sizes else None,
    }


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, int(len(ordered) * q))]
