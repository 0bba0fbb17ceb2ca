"""/metrics' text format: byte for byte prometheus_client's, and nothing kept of old series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.observability.exposition import TextExposition


async def test_the_server_registry_renders_as_generate_latest_does():
    async with Engine(Config(devices="sim:2"), clock=FakeClock()) as engine:
        for n in range(50):
            await engine.infer(f"x{n}")
        assert engine.metrics is not None
        registry = engine.metrics.registry
        exposition = TextExposition(registry)
        for _ in range(2):  # the second from what the first kept
            assert exposition.render() == generate_latest(registry)


def test_escapes_labels_and_drops_series_that_are_gone():
    registry = CollectorRegistry()
    counter = Counter("odd", "Help with a \\ and\na newline.", ["label"], registry=registry)
    for value in ('a"b', "back\\slash", "new\nline", "plain", "ünï"):
        counter.labels(value).inc()
    Gauge("vllm:colon_name", "A name with a colon.", registry=registry).set(0.25)
    Histogram("h", "A histogram.", registry=registry).observe(3)
    exposition = TextExposition(registry)
    assert exposition.render() == generate_latest(registry)
    counter.remove("plain")
    assert exposition.render() == generate_latest(registry)
    assert not [key for key in exposition._series if key[1] == (("label", "plain"),)]
