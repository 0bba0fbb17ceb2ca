"""/metrics' text format: byte for byte prometheus_client's, nothing kept of old series, and
a kept render reused for at most its max age, the live collectors written afresh."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Prompt
from batchserve.observability.exposition import Gauges, Scrape, TextCollector, TextExposition
from batchserve.observability.loop_metrics import LoopCounters, LoopHistograms


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


def test_loop_families_write_what_generate_latest_writes_and_show_each_change():
    # Each family of ours writes its own lines and keeps a histogram child's until it counts
    # something new: a count or a new series must show in the very next scrape.
    registry = CollectorRegistry()
    histograms = LoopHistograms("h_seconds", 'Odd \\ help\nhere "quoted".', ["model"], [0.1, 1.0])
    counters = LoopCounters("c", "A counter.", ["model", "code"])
    registry.register(histograms)
    registry.register(counters)
    exposition = TextExposition(registry)
    assert exposition.render() == generate_latest(registry)  # no series yet
    odd, plain = histograms.child('a"b\\c\nd'), histograms.child("plain")
    histograms.observe(odd, 0.05)
    counters.child("ünï", "200").value += 1
    assert exposition.render() == generate_latest(registry)
    histograms.observe(plain, 2.0, times=3)  # only this child changed
    counters.child("ünï", "200").value += 1_000_000  # past the short way of writing counts
    text = exposition.render()
    assert text == generate_latest(registry)
    assert b'h_seconds_bucket{le="+Inf",model="plain"} 3.0' in text
    assert b'c_total{code="200",model="\xc3\xbcn\xc3\xaf"} 1.000001e+06' in text
    histograms.observe(odd, 0.0)  # a count that leaves the sum as it was
    text = exposition.render()
    assert text == generate_latest(registry)
    assert b'h_seconds_count{model="a\\"b\\\\c\\nd"} 2.0' in text
    histograms.remove_where(lambda values: values == ("plain",))
    assert exposition.render() == generate_latest(registry)
    assert b"plain" not in exposition.render()


async def test_a_generation_server_renders_as_generate_latest_does_as_it_changes():
    async with Engine(Config(generator="sim", devices="sim:2")) as engine:
        assert engine.metrics is not None
        registry = engine.metrics.registry
        exposition = TextExposition(registry)
        assert exposition.render() == generate_latest(registry)
        for n in range(3):
            async with engine.generate(Prompt(f"prompt {n}", max_tokens=4)) as gen:
                await gen.result()
            text = exposition.render()
            assert text == generate_latest(registry)
            assert "batchserve_generation_steps_total{" in text.decode()


async def test_the_next_scrape_shows_each_new_batch_and_answer():
    # The batch-size histogram's and the loop families' kept lines must not hide a change.
    async with Engine(Config(devices="sim:2"), clock=FakeClock()) as engine:
        assert engine.metrics is not None
        registry = engine.metrics.registry
        exposition = TextExposition(registry)
        for n in range(1, 4):
            await engine.infer(f"x{n}")
            text = exposition.render()
            assert text == generate_latest(registry)
            assert f"batchserve_batch_size_count {n}.0\n".encode() in text
            latency = 'batchserve_request_latency_seconds_count{model="default",version="1"}'
            assert f"{latency} {n}.0\n".encode() in text


def test_histogram_counts_past_the_short_way_and_braces_in_labels_render_as_generate_latest():
    # A child's bucket and count lines are written from a template while its counts are
    # small: a label value with braces must not break it, nor counts past a million.
    registry = CollectorRegistry()
    histograms = LoopHistograms("h_seconds", "A histogram.", ["model"], [0.1, 1.0])
    registry.register(histograms)
    exposition = TextExposition(registry)
    braced = histograms.child("{0}{}")
    histograms.observe(braced, 0.05)
    assert exposition.render() == generate_latest(registry)
    histograms.observe(braced, 0.5, times=1_500_000)
    text = exposition.render()
    assert text == generate_latest(registry)
    assert b'h_seconds_count{model="{0}{}"} 1.500001e+06' in text


class LiveGauge(TextCollector):
    """A live collector, as the picker's is: written at every scrape of a kept render."""

    live = True

    def __init__(self) -> None:
        self.value = 0.0
        self._gauges = Gauges([("live_now", "A gauge a router reads between scrapes.")])

    def scrape(self, out: Scrape) -> None:
        out.gauges(self._gauges, [self.value])


def test_a_kept_render_serves_until_max_age_with_the_live_collectors_written_afresh():
    registry = CollectorRegistry()
    counters = LoopCounters("c", "A counter.", ["model"])
    registry.register(counters)
    live = LiveGauge()
    registry.register(live)
    theirs = Counter("p", "prometheus_client's own.", registry=registry)
    max_age_s = [0.5]  # read at each render, as a reload changes it
    exposition = TextExposition(registry, lambda: max_age_s[0])
    counters.child("a").value += 1
    first = exposition.render(now=10.0)
    assert first == generate_latest(registry)
    counters.child("a").value += 1
    theirs.inc()
    live.value = 3.0
    # Younger than the max age: the counters as they were, the live gauge as it is now.
    kept = exposition.render(now=10.499)
    assert kept == first.replace(b"live_now 0.0", b"live_now 3.0")
    assert kept != generate_latest(registry)
    assert exposition.render(now=10.5) == generate_latest(registry)  # as old as allowed: anew
    counters.remove_where(lambda values: values == ("a",))  # a deleted version's series
    assert b'c_total{model="a"} 2.0' in exposition.render(now=10.999)  # within the max age
    assert exposition.render(now=11.0) == generate_latest(registry)  # and gone after it
    assert b'model="a"' not in exposition.render(now=11.0)
    counters.child("b").value += 1
    max_age_s[0] = 0.0  # reloaded to 0: every render anew
    assert exposition.render(now=11.0) == generate_latest(registry)
    max_age_s[0] = 0.5
    exposition.render(now=20.0)
    registry.register(LoopCounters("d", "Registered after the render.", []))
    assert exposition.render(now=20.0) == generate_latest(registry)  # a new collector: anew


async def test_the_picker_families_are_written_once_in_metrics_and_in_collect():
    # The picker's live collector writes them; the state collector must not write them too.
    async with Engine(Config(devices="sim:2"), clock=FakeClock()) as engine:
        await engine.infer("x")
        assert engine.metrics is not None
        registry = engine.metrics.registry
        names = [family.name for family in registry.collect()]
        assert len(names) == len(set(names))
        assert {"vllm:num_requests_waiting", "batchserve_queue_depth"} <= set(names)
        exposition = TextExposition(registry, lambda: 0.5)
        for now in (0.0, 0.1):  # a full render, then a kept one
            text = exposition.render(now).decode()
            typed = re.findall(r"^# TYPE (\S+) ", text, re.M)
            assert len(typed) == len(set(typed))
            assert text.count("# TYPE vllm:num_requests_waiting gauge") == 1
