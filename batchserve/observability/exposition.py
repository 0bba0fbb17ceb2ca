"""/metrics in Prometheus' text format, byte for byte what `generate_latest` writes, cheaper.

Over 450 lines because the kept text's pieces (the series' names, the families' own
writers, the kept render and its age rule) must agree byte for byte on one format: split,
each half would have to know the other's layout.

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
(`generate_latest`, a test's `get_sample_value`). A `TextCollector` (every collector of
batchserve's own) writes its families once, in `scrape`: straight into /metrics' text,
which then makes no family object and skips `CollectorRegistry.collect()`, or as those
`Written` families for `collect()`; `Gauges` writes unlabelled gauges from one template.

Even so, the whole exposition re-rendered 20 times a second cost 0.4-1.5 % of a core at
1,000 rps, for a picker that reads three gauges of it, while the counters and histograms
are for Prometheus, which scrapes every few seconds. So a `TextExposition` given a
`max_age_s` keeps the text of a full render (`KeptText`) and, while it is younger than
that, serves it again with only the `live` collectors (the picker's gauges) written anew:
every other family may be up to `max_age_s` old, never newer than a later render, so a
counter read twice never goes back. A series removed (a deleted model version) leaves at
the next full render, within `max_age_s`. The age is read on the caller's clock (`now`),
so the rule is tested without sleeps; `collect()` readers (`generate_latest`, tests) are
never served from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import ClassVar, cast

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_go_float = cast(Callable[[float], str], floatToGoString)

_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
"""OpenMetrics samples that the text format moves to a gauge family of their own."""
_PROMETHEUS_TYPE = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram",
                    "unknown": "untyped"}  # fmt: skip

_SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


class TextExposition:
    """Renders a registry as `generate_latest(registry)` does; one per registry.

    With `max_age_s` (read at each render, so a reload may change it) above 0, a render
    at `now` reuses the last full render's text while it is younger than that, writing
    only the `live` collectors again (see the module's docstring)."""

    def __init__(
        self, registry: CollectorRegistry, max_age_s: Callable[[], float] = lambda: 0.0
    ) -> None:
        self._registry = registry
        self._max_age_s = max_age_s
        self._series: dict[_SeriesKey, str] = {}
        """Each series seen at the last scrape: its `name{labels}` as written."""
        self._text_types: dict[type, bool] = {}
        """Per type of collector, whether it is a `TextCollector` (an ABC's isinstance is
        slow)."""
        self._kept: KeptText | None = None
        """The last full render, while `max_age_s` is above 0."""

    def render(self, now: float = 0.0) -> bytes:
        """The exposition at `now` (the clock `max_age_s` is measured on)."""
        registry = self._registry
        # prometheus_client's own fields, read as registry.collect() reads them (it has no
        # public list of collectors); were they to move, generate_latest stays correct.
        lock = getattr(registry, "_lock", None)
        names = getattr(registry, "_collector_to_names", None)
        if lock is None or not isinstance(names, dict):
            return generate_latest(registry)
        with lock:
            collectors = list(names)
            target_info = bool(getattr(registry, "_target_info", None))
        if target_info:
            return generate_latest(registry)
        max_age_s = self._max_age_s()
        kept = self._kept
        if kept is not None and kept.serves(now, max_age_s, collectors):
            return kept.render()
        self._kept = None
        seen: dict[_SeriesKey, str] = {}
        output: list[str] = []
        parts: list[str | TextCollector] = []  # to keep: each collector's text, or it if live
        for collector in collectors:
            is_text = self._text_types.get(type(collector))
            if is_text is None:
                is_text = self._text_types[type(collector)] = isinstance(collector, TextCollector)
            start = len(output)
            if is_text:
                text_collector = cast(TextCollector, collector)
                output.append(text_collector.text())  # no family objects
                if text_collector.live:
                    parts.append(text_collector)
                    continue
            else:
                for metric in collector.collect():
                    if not self._metric(metric, seen, output):
                        return generate_latest(registry)  # names to escape: its own way
            if max_age_s > 0:
                parts.append("".join(output[start:]))
        self._series = seen
        if max_age_s > 0:
            self._kept = KeptText(now, collectors, parts)
        return "".join(output).encode()

    def _metric(self, metric: Metric, seen: dict[_SeriesKey, str], output: list[str]) -> bool:
        """Writes `metric` to `output`; False if it has names that the text format escapes."""
        if isinstance(metric, Written):
            output.append(metric.text)
            return True
        name, kind = metric.name, metric.type
        if kind == "counter":
            name += "_total"
        elif kind == "info":
            name += "_info"
        kind = _PROMETHEUS_TYPE.get(kind, kind)
        text = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        if not _plain(name):
            return False
        output.append(f"# HELP {name} {text}\n# TYPE {name} {kind}\n")
        moved: dict[str, list[str]] = {}
        for sample in metric.samples:
            line = self._line(sample, seen)
            if line is None:
                return False
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
        return True

    def _line(self, sample: Sample, seen: dict[_SeriesKey, str]) -> str | None:
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
        seen[key] = series
        if sample.timestamp is not None:
            stamp = int(float(sample.timestamp) * 1000)
            return f"{series} {_go_float(sample.value)} {stamp:d}\n"
        return f"{series} {_go_float(sample.value)}\n"


class KeptText:
    """A full render of a registry kept for reuse: the text of each run of collectors that
    are not live, as bytes, between the live ones, which write again at each reuse."""

    def __init__(
        self, rendered_at: float, collectors: list[Collector], parts: list[str | TextCollector]
    ) -> None:
        self.rendered_at = rendered_at
        self._collectors = collectors
        self._parts: list[bytes | TextCollector] = []
        run: list[str] = []
        for part in parts:
            if isinstance(part, str):
                run.append(part)
                continue
            self._parts += ["".join(run).encode(), part]
            run = []
        self._parts.append("".join(run).encode())

    def serves(self, now: float, max_age_s: float, collectors: list[Collector]) -> bool:
        """Whether this render may stand for one at `now`: younger than `max_age_s` (0
        reuses nothing), of the same collectors (one registered since renders again)."""
        return (
            0.0 <= now - self.rendered_at < max_age_s
            and len(collectors) == len(self._collectors)
            and all(a is b for a, b in zip(collectors, self._collectors, strict=True))
        )

    def render(self) -> bytes:
        return b"".join(
            [part if isinstance(part, bytes) else part.text().encode() for part in self._parts]
        )


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
        return Written(self, self.text(rows), lambda: self._family(rows))

    def text(self, rows: list[Row]) -> str:
        """The lines of these series, for this scrape."""
        old, kept = self._series, {}
        lines = [self._header]
        for values, value in rows:
            series = old.get(values)
            if series is None:
                series = self._sample_name + self._braced(values)
            kept[values] = series
            lines.append(f"{series} {_number(value)}\n")
        self._series = kept
        return "".join(lines)

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
        self._children: dict[tuple[str, ...], _Lines] = {}
        """Per label values: how the child's lines are written, and its last writing."""

    def write_children(self, children: list[Child]) -> Written:
        written = [(values, list(accumulate(counts)), s) for values, counts, s in children]
        return Written(self, self.text_children(children), lambda: self._histograms(written))

    def text_children(self, children: list[Child]) -> str:
        """The lines of these children, for this scrape."""
        old, kept = self._children, {}
        lines = [self._header]
        for values, counts, sum_value in children:
            total = sum(counts)
            known = old.get(values)
            if known is None:
                known = self._lines(values)
            elif known.count == total and known.sum == sum_value:
                kept[values] = known
                lines.append(known.text)
                continue
            cumulative = list(accumulate(counts))
            if type(total) is int and 0 <= total < 1_000_000:  # counts: the short way
                text = known.counts.format(*cumulative, total)
            else:
                buckets = known.series[:-2]  # as many as the counts
                text = "".join(
                    [*(f"{name} {_number(n)}\n"
                       for name, n in zip(buckets, cumulative, strict=True)),
                     f"{known.series[-2]} {_number(total)}\n"]
                )  # fmt: skip
            known.text = f"{text}{known.series[-1]} {_number(sum_value)}\n"
            known.count, known.sum = total, sum_value
            kept[values] = known
            lines.append(known.text)
        self._children = kept
        return "".join(lines)

    def _lines(self, values: tuple[str, ...]) -> _Lines:
        series = (
            *(f"{self.name}_bucket{self._braced(values, (('le', bound),))}"
              for bound in self._bounds),
            f"{self.name}_count{self._braced(values)}",
            f"{self.name}_sum{self._braced(values)}",
        )  # fmt: skip
        counts = "".join(
            name.replace("{", "{{").replace("}", "}}") + " {}.0\n" for name in series[:-1]
        )
        return _Lines(series, counts)

    def _histograms(self, written: list[tuple[tuple[str, ...], list[int], float]]) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, cumulative, sum_value in written:
            buckets = list(zip(self._bounds, cumulative, strict=True))
            family.add_metric(list(values), buckets, sum_value)
        return family


class _Lines:
    """A histogram child's lines: each one's `name{labels}` (each bucket's, then _count's
    and _sum's), a template of the bucket and count lines for counts written the short way,
    and the count, sum and text of its last writing."""

    __slots__ = ("count", "counts", "series", "sum", "text")

    def __init__(self, series: tuple[str, ...], counts: str) -> None:
        self.series, self.counts = series, counts
        self.count = -1
        self.sum = math.nan
        self.text = ""


class Gauges:
    """Unlabelled gauges in a fixed order, written as one template: only the values are
    formatted at a scrape."""

    def __init__(self, gauges: Sequence[tuple[str, str]]) -> None:
        """`gauges`: each one's name and help."""
        self._writers = tuple(FamilyText(name, text, "gauge") for name, text in gauges)
        self._heads = tuple(f"{w._header}{w.name} " for w in self._writers)

    def text(self, values: Sequence[float]) -> str:
        return "".join(
            [f"{head}{_number(value)}\n" for head, value in zip(self._heads, values, strict=True)]
        )

    def write(self, values: Sequence[float]) -> list[Metric]:
        return [w.write([((), v)]) for w, v in zip(self._writers, values, strict=True)]


class Scrape:
    """What a `TextCollector` writes at one scrape: its text alone (for `TextExposition`),
    or its `Written` families (for `collect()`, which `generate_latest` and tests read)."""

    def __init__(self, as_text: bool) -> None:
        self.as_text = as_text
        self.parts: list[str] = []
        self.families: list[Metric] = []

    def gauges(self, gauges: Gauges, values: Sequence[float]) -> None:
        if self.as_text:
            self.parts.append(gauges.text(values))
        else:
            self.families.extend(gauges.write(values))

    def family(self, writer: FamilyText, rows: list[Row]) -> None:
        if self.as_text:
            self.parts.append(writer.text(rows))
        else:
            self.families.append(writer.write(rows))

    def histogram(self, writer: HistogramText, children: list[Child]) -> None:
        if self.as_text:
            self.parts.append(writer.text_children(children))
        else:
            self.families.append(writer.write_children(children))


class TextCollector(Collector):
    """A collector of batchserve's own families: `scrape` writes them once for both ways of
    reading them, `text()` (a scrape of /metrics, no family objects made) and `collect()`."""

    live: ClassVar[bool] = False
    """True: /metrics writes its families at every scrape, never from a kept render
    (`TextExposition`'s `max_age_s`): the few gauges a router reads between scrapes."""

    def scrape(self, out: Scrape) -> None:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        out = Scrape(as_text=False)
        self.scrape(out)
        return iter(out.families)

    def text(self) -> str:
        out = Scrape(as_text=True)
        self.scrape(out)
        return "".join(out.parts)


def _number(value: float) -> str:
    """`value` as the text format writes it (prometheus_client's floatToGoString), with a
    short way for the counts that most values are."""
    if type(value) is int and 0 <= value < 1_000_000:
        return f"{value}.0"
    return _go_float(value)
