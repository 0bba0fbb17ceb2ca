"""The generation models' families on /metrics: sequences running and waiting, the KV
budget, steps, preemptions, failures, hung steps and the prefix cache's queries and hits,
read from each model's snapshot at scrape time (`metrics.py` holds the rest)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..clock import Clock
from ..generation.models import Generators
from .exposition import FamilyText, Scrape, TextCollector


class GenerationCollector(TextCollector):
    """Reads the generation models' snapshots at scrape time."""

    def __init__(self, generators: Generators, clock: Clock) -> None:
        self._generators = generators
        self._clock = clock
        self._writers = [
            (key, FamilyText(name, text, kind, ["model", "version"]))
            for key, name, text, kind in _GENERATION_FAMILIES
        ]
        self._vllm_writers = [
            (key, FamilyText(name, text, "counter", ["model_name"]))
            for key, name, text in _VLLM_PREFIX_FAMILIES
        ]

    def summary(self, now: float) -> list[dict[str, Any]]:
        return [
            {**dataclasses.asdict(stats), "devices": list(stats.devices)}
            for stats in (model.stats(now) for model in self._generators)
        ]

    def scrape(self, out: Scrape) -> None:
        now = self._clock.time()
        rows = [model.stats(now) for model in self._generators]
        for key, writer in self._writers:
            out.family(writer, [((r.model, r.version), getattr(r, key)) for r in rows])
        for key, writer in self._vllm_writers:
            by_model: dict[str, int] = {}
            for r in rows:
                by_model[r.model] = by_model.get(r.model, 0) + getattr(r, key)
            out.family(writer, [((model,), value) for model, value in by_model.items()])


_GENERATION_FAMILIES: list[tuple[str, str, str, str]] = [
    ("running", "batchserve_sequences_running", "Sequences in steps now.", "gauge"),
    ("waiting", "batchserve_sequences_waiting", "Sequences waiting to run.", "gauge"),
    (
        "kv_used_tokens",
        "batchserve_kv_used_tokens",
        "KV-cache tokens the running sequences hold, over all devices.",
        "gauge",
    ),
    (
        "kv_budget_tokens",
        "batchserve_kv_budget_tokens",
        "KV-cache tokens the devices can hold at once, summed.",
        "gauge",
    ),
    ("steps", "batchserve_generation_steps", "Decoding steps run.", "counter"),
    (
        "preemptions",
        "batchserve_preemptions",
        "Sequences put back in line because the running ones outgrew the budget.",
        "counter",
    ),
    (
        "step_failures",
        "batchserve_step_failures",
        "Steps that raised or answered badly (each is retried in halves).",
        "counter",
    ),
    (
        "prefix_queries",
        "batchserve_prefix_cache_queries",
        "Tokens of sequences admitted to a device, looked up in its prefix cache.",
        "counter",
    ),
    (
        "prefix_hits",
        "batchserve_prefix_cache_hits",
        "Of the tokens looked up in a prefix cache, those found there (not computed again).",
        "counter",
    ),
    (
        "prefill_tokens",
        "batchserve_prefill_tokens",
        "Prompt tokens computed before each sequence's first token; a prefix taken from the"
        " cache, or one of n choices' prompt copied from its sibling, is not computed.",
        "counter",
    ),
    (
        "hung_steps",
        "batchserve_hung_steps",
        "Device calls (steps, releases) that ran past their budget (their sequences"
        " went on elsewhere).",
        "counter",
    ),
]


_VLLM_PREFIX_FAMILIES = [
    (
        "prefix_queries",
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in tokens (vLLM's name; batchserve_prefix_cache_queries).",
    ),
    (
        "prefix_hits",
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in tokens (vLLM's name; batchserve_prefix_cache_hits).",
    ),
]
"""The prefix cache's counters under vLLM's names, as its dashboards and the inference
gateway's tooling read them (per model, as vLLM labels them)."""
