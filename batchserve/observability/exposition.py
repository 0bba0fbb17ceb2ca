"""/metrics in Prometheus' text format, byte for byte what `generate_latest` writes, cheaper.

The inference gateway's picker scrapes every pod 20 times a second. `generate_latest` checks
and escapes every series' name and labels at every scrape, which was half of a scrape's
2 ms at 1,000 requests a second (benchmarks/scrape_cost.py). The series are the same from
one scrape to the next, so each one's `name{labels}` is written once and kept while the
series is still there: what a scrape does not see is dropped, so series removed (a deleted
model version) do not stay.

batchserve's own families go further (`FamilyText`, `HistogramText`): each writes its own
lines, its header and each series' `name{labels}` kept from scrape to scrape and a
histogram child's lines kept until it counts something new, and hands the scrape a
`Written` family whose sample objects are made only if something asks for them
(`generate_latest`, a test's `get_sample_value`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import cast

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_go_float = cast(Callable[[float], str], floatToGoString)

_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
"""OpenMetrics samples that the text format moves to a gauge family of their own."""
_PROMETHEUS_TYPE = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram",
                    "unknown": "untyped"}  # fmt: skip

_SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


class TextExposition:
    """Renders a registry as `generate_latest(registry)` does; one per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._series: dict[_SeriesKey, str] = {}
        """Each series seen at the last scrape: its `name{labels}` as written."""

    def render(self) -> bytes:
        kept: dict[_SeriesKey, str] = {}
        output: list[str] = []
        for metric in self._registry.collect():
            if isinstance(metric, Written):
                output.append(metric.text)
                continue
            name, kind = metric.name, metric.type
            if kind == "counter":
                name += "_total"
            elif kind == "info":
                name += "_info"
            kind = _PROMETHEUS_TYPE.get(kind, kind)
            text = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            if not _plain(name):
                return generate_latest(self._registry)  # names to escape: its own way
            output.append(f"# HELP {name} {text}\n# TYPE {name} {kind}\n")
            moved: dict[str, list[str]] = {}
            for sample in metric.samples:
                line = self._line(sample, kept)
                if line is None:
                    return generate_latest(self._registry)
                suffix = sample.name[len(metric.name) :]
                if suffix in _OM_SUFFIXES and sample.name.startswith(metric.name):
                    moved.setdefault(suffix, []).append(line)
                else:
                    output.append(line)
            for suffix, lines in sorted(moved.items()):
                output.append(
                    f"# HELP {metric.name}{suffix} {text}\n# TYPE {metric.name}{suffix} gauge\n"
                )
                output.extend(lines)
        self._series = kept
        return "".join(output).encode()

    def _line(self, sample: Sample, kept: dict[_SeriesKey, str]) -> str | None:
        key = (sample.name, tuple(sample.labels.items()))
        series = self._series.get(key)
        if series is None:
            if not _plain(sample.name) or not all(map(_plain_label, sample.labels)):
                return None
            series = sample.name
            if sample.labels:
                pairs = ",".join(
                    f'{label}="{_escaped(value)}"' for label, value in sorted(sample.labels.items())
                )
                series += f"{{{pairs}}}"
        kept[key] = series
        if sample.timestamp is not None:
            stamp = int(float(sample.timestamp) * 1000)
            return f"{series} {_go_float(sample.value)} {stamp:d}\n"
        return f"{series} {_go_float(sample.value)}\n"


def _plain(name: str) -> bool:
    """A name the text format writes as it is: [a-zA-Z_:][a-zA-Z0-9_:]*, ASCII."""
    return (
        bool(name)
        and name.isascii()
        and not name[0].isdigit()
        and name.replace("_", "a").replace(":", "a").isalnum()
    )


def _plain_label(name: str) -> bool:
    """A label name the text format writes as it is: [a-zA-Z_][a-zA-Z0-9_]*, ASCII."""
    return ":" not in name and _plain(name)


def _escaped(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class Written(Metric):
    """A family that wrote its own text (`text`, what `generate_latest` would write of it);
    its samples are made by `make` when first asked for."""

    def __init__(self, family: FamilyText, text: str, make: Callable[[], Metric]) -> None:
        # Metric.__init__ checks the name at every scrape; the writer checked it once.
        self.name, self.documentation, self.unit = family.name, family.documentation, ""
        self.type = family.type
        self.text = text
        self._make: Callable[[], Metric] | None = make
        self._samples: list[Sample] = []

    @property
    def samples(self) -> list[Sample]:
        if self._make is not None:
            self._samples, self._make = self._make().samples, None
        return self._samples

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        self._samples, self._make = samples, None


Row = tuple[tuple[str, ...], float]
"""A counter's or gauge's series: its label values and its value."""


class FamilyText:
    """A counter or gauge family of batchserve's own, written as `generate_latest` writes
    it: the header once, each series' `name{labels}` while the series lasts."""

    def __init__(
        self, name: str, documentation: str, kind: str, labels: Sequence[str] = ()
    ) -> None:
        if not _plain(name) or not all(map(_plain_label, labels)) or "le" in labels:
            raise ValueError(f"{name}{list(labels)}: not a name the text format writes as is")
        self.name, self.documentation, self.type = name, documentation, kind
        self.labels = tuple(labels)
        self._sample_name = name + "_total" if kind == "counter" else name
        shown = self._sample_name
        text = documentation.replace("\\", r"\\").replace("\n", r"\n")
        kind_shown = _PROMETHEUS_TYPE.get(kind, kind)
        self._header = f"# HELP {shown} {text}\n# TYPE {shown} {kind_shown}\n"
        self._series: dict[tuple[str, ...], str] = {}

    def write(self, rows: list[Row]) -> Written:
        """The family of these series (label values in `labels`' order), for this scrape."""
        old, kept = self._series, {}
        lines = [self._header]
        for values, value in rows:
            series = old.get(values)
            if series is None:
                series = self._sample_name + self._braced(values)
            kept[values] = series
            lines.append(f"{series} {_number(value)}\n")
        self._series = kept
        return Written(self, "".join(lines), lambda: self._family(rows))

    def _braced(self, values: Sequence[str], extra: tuple[tuple[str, str], ...] = ()) -> str:
        pairs = sorted([*zip(self.labels, values, strict=True), *extra])
        if not pairs:
            return ""
        return "{" + ",".join(f'{label}="{_escaped(value)}"' for label, value in pairs) + "}"

    def _family(self, rows: list[Row]) -> Metric:
        kind = CounterMetricFamily if self.type == "counter" else GaugeMetricFamily
        family = kind(self.name, self.documentation, labels=self.labels)
        for values, value in rows:
            family.add_metric(list(values), value)
        return family


Child = tuple[tuple[str, ...], Sequence[int], float]
"""A histogram's series: its label values, its count in each bucket (not cumulative; the
last above every bound) and its sum."""


class HistogramText(FamilyText):
    """A histogram family of batchserve's own, written as `generate_latest` writes it; a
    child's lines are kept until it counts something new."""

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], bounds: Sequence[str]
    ) -> None:
        """`bounds`: each bucket's `le` as written, +Inf last."""
        super().__init__(name, documentation, "histogram", labels)
        self._bounds = tuple(bounds)
        self._children: dict[tuple[str, ...], tuple[tuple[str, ...], int, float, str]] = {}
        """Per label values: the lines' `name{labels}` (each bucket's, then _count's and
        _sum's), and the count, sum and text of the child's last writing."""

    def write_children(self, children: list[Child]) -> Written:
        old, kept = self._children, {}
        lines = [self._header]
        written: list[tuple[tuple[str, ...], list[int], float]] = []
        for values, counts, sum_value in children:
            cumulative = list(accumulate(counts))
            written.append((values, cumulative, sum_value))
            known = old.get(values)
            if known is None:
                series = (
                    *(f"{self.name}_bucket{self._braced(values, (('le', bound),))}"
                      for bound in self._bounds),
                    f"{self.name}_count{self._braced(values)}",
                    f"{self.name}_sum{self._braced(values)}",
                )  # fmt: skip
            elif known[1] == cumulative[-1] and known[2] == sum_value:
                kept[values] = known
                lines.append(known[3])
                continue
            else:
                series = known[0]
            buckets = series[:-2]  # as many as the counts
            text = "".join(
                [*(f"{name} {_number(n)}\n" for name, n in zip(buckets, cumulative, strict=True)),
                 f"{series[-2]} {_number(cumulative[-1])}\n",
                 f"{series[-1]} {_number(sum_value)}\n"]
            )  # fmt: skip
            kept[values] = (series, cumulative[-1], sum_value, text)
            lines.append(text)
        self._children = kept
        return Written(self, "".join(lines), lambda: self._histograms(written))

    def _histograms(self, written: list[tuple[tuple[str, ...], list[int], float]]) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, cumulative, sum_value in written:
            buckets = list(zip(self._bounds, cumulative, strict=True))
            family.add_metric(list(values), buckets, sum_value)
        return family


class Families:
    """A collector's writers, by family name, each made at its first scrape and kept."""

    def __init__(self) -> None:
        self._writers: dict[str, FamilyText] = {}
        self._histograms: dict[str, HistogramText] = {}

    def write(
        self, kind: str, name: str, documentation: str, rows: list[Row], labels: Sequence[str] = ()
    ) -> Written:
        """A counter or gauge family of these series."""
        writer = self._writers.get(name)
        if writer is None:
            writer = self._writers[name] = FamilyText(name, documentation, kind, labels)
        return writer.write(rows)

    def gauge(self, name: str, documentation: str, value: float) -> Written:
        """An unlabelled gauge."""
        return self.write("gauge", name, documentation, [((), value)])

    def histogram(
        self, name: str, documentation: str, bounds: Sequence[str], children: list[Child]
    ) -> Written:
        writer = self._histograms.get(name)
        if writer is None:
            writer = self._histograms[name] = HistogramText(name, documentation, (), bounds)
        return writer.write_children(children)


def _number(value: float) -> str:
    """`value` as the text format writes it (prometheus_client's floatToGoString), with a
    short way for the counts that most values are."""
    if type(value) is int and 0 <= value < 1_000_000:
        return f"{value}.0"
    return _go_float(value)
