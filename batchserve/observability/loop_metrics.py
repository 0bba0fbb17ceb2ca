"""Histograms and counters observed on the event loop only: for the per-request ones.

prometheus-client's Histogram and Counter take a lock on every observation (and a Histogram
scans its buckets), since any thread may observe; the hot path's observations all happen on
the loop, so a list of counts found by bisection and a running sum, or a plain number, do the
same for a fraction of the cost (measured in benchmarks/README.md, "Cost of metrics"). A
scrape reads them into the same exposition (`_bucket`, `_sum`, `_count`; `_total`) a
Histogram or Counter would give, written by `exposition.py`'s writers (the lines of a
child that counted nothing since the last scrape are kept).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from .exposition import FamilyText, HistogramText, Scrape, TextCollector

Child = TypeVar("Child")


class LoopHistogram:
    __slots__ = ("counts", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        """Per bucket, the last for values above every bound (+Inf)."""
        self.sum = 0.0


class _LoopFamily(TextCollector, Generic[Child]):
    """A family of children, one per label values, each made on first use by `make_child`."""

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], make_child: Callable[[], Child]
    ) -> None:
        self._name, self._documentation = name, documentation
        self._labels = list(labels)
        self._make_child = make_child
        self._children: dict[tuple[str, ...], Child] = {}

    def remove_where(self, match: Callable[[tuple[str, ...]], bool]) -> None:
        """Drops the children whose label values `match` (a removed model version's)."""
        for values in [values for values in self._children if match(values)]:
            del self._children[values]

    def child(self, *values: str) -> Child:
        """The child of these label values; keep it, as with labels()."""
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._make_child()
        return child


class LoopHistograms(_LoopFamily[LoopHistogram]):
    """One histogram family, a child per label values; register it like a Histogram."""

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], bounds: Sequence[float]
    ) -> None:
        super().__init__(name, documentation, labels, lambda: LoopHistogram(len(bounds)))
        self._bounds = list(bounds)
        les = [*map(_bound, self._bounds), "+Inf"]
        self._text = HistogramText(name, documentation, labels, les)

    def observe(self, child: LoopHistogram, value: float, times: int = 1) -> None:
        """Counts `value`, `times` over (le bounds are inclusive, as Prometheus's)."""
        child.counts[bisect_left(self._bounds, value)] += times
        child.sum += value * times

    def observe_each(self, child: LoopHistogram, values: Iterable[float]) -> None:
        """Counts each of `values`: one call for a batch's requests."""
        counts, bounds = child.counts, self._bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1
            child.sum += value

    def scrape(self, out: Scrape) -> None:
        out.histogram(
            self._text,
            [(values, child.counts, child.sum) for values, child in self._children.items()],
        )


class LoopCount:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


class LoopCounters(_LoopFamily[LoopCount]):
    """One counter family, a child per label values (add to its `value`); register it like a
    Counter."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        super().__init__(name, documentation, labels, LoopCount)
        self._text = FamilyText(name, documentation, "counter", labels)

    def scrape(self, out: Scrape) -> None:
        out.family(self._text, [(values, child.value) for values, child in self._children.items()])


def _bound(bound: float) -> str:
    """The `le` label as prometheus-client writes it (0.005, 1.0, +Inf)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))
