"""/metrics in Prometheus' text format, byte for byte what `generate_latest` writes, cheaper.

The inference gateway's picker scrapes every pod 20 times a second. `generate_latest` checks
and escapes every series' name and labels at every scrape, which was half of a scrape's
2 ms at 1,000 requests a second (benchmarks/scrape_cost.py). The series are the same from
one scrape to the next, so each one's `name{labels}` is written once and kept while the
series is still there: what a scrape does not see is dropped, so series removed (a deleted
model version) do not stay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

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
