"""Settings from a file (`--config FILE`, TOML, the flags' names) and what a reload may change.

The file gives defaults that the environment (BATCHSERVE_*) and then the command line
override. On SIGHUP the CLI reads it again into a whole new `Config` (a bad file is refused
whole, and the old settings stay); `live_changes` then splits the difference into what
applies to a running server and what cannot change without a restart, which keeps its old
value. For the models file, `model_changes` says which versions to add, remove, reweight and
retune, and which changed in ways only a restart applies.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from .config import Config, read_toml
from .errors import StartupError
from .models.specs import ModelSpec

RESTART_ONLY = frozenset(
    {
        "host", "port", "tcp", "uds", "uds_mode", "devices", "fn", "fn_per_device",
        "generator", "generate_mode", "metrics", "policy", "sim_latency_ms", "sim_cost",
        "sim_fail_rate", "sim_hang_rate", "sim_bad_output_rate", "sim_hang_ms", "sim_seed",
        "sim_step_ms", "sim_kv_budget", "bisect_failures", "retry_budget", "retry_reserve",
        "poison_memory", "result_store", "result_store_size", "trace", "cpu_threads", "preload",
        "shared_batch_ratio",
    }
)  # fmt: skip
"""Settings a running server keeps until restarted: where it listens, its devices and
what is loaded on them, and the parts built once at start."""
RETUNABLE = ("max_batch_size", "max_linger_ms")
"""A model version's fields that apply to its next batches without a reload of weights."""


def read_config_file(path: str, known: set[str]) -> dict[str, Any]:
    """The file's settings by Config field name (`max-batch-size` or `max_batch_size`);
    StartupError names an unreadable file or an unknown name."""
    document = read_toml(path, "--config")
    settings = {name.replace("-", "_"): value for name, value in document.items()}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise StartupError(f"--config {path}: no such setting: {', '.join(unknown)}")
    return settings


class LiveChanges(NamedTuple):
    config: Config
    """The new settings, with every restart-only one kept at its running value."""
    changed: list[str]
    """Names that changed and apply now."""
    kept: list[str]
    """Names that changed in the file but apply only after a restart."""


def live_changes(running: Config, wanted: Config) -> LiveChanges:
    changed = [
        field.name
        for field in dataclasses.fields(Config)
        if getattr(running, field.name) != getattr(wanted, field.name)
    ]
    kept = [name for name in changed if name in RESTART_ONLY]
    config = dataclasses.replace(wanted, **{name: getattr(running, name) for name in kept})
    return LiveChanges(config, [name for name in changed if name not in RESTART_ONLY], kept)


class ModelChanges(NamedTuple):
    add: list[ModelSpec]
    remove: list[tuple[str, str]]
    reweigh: list[ModelSpec]
    retune: list[ModelSpec]
    kept: list[str]
    """Versions whose other fields (fn, devices, ...) changed: they apply after a restart."""


def model_changes(running: list[ModelSpec], wanted: list[ModelSpec]) -> ModelChanges:
    """What turns the running versions into the wanted ones, by (name, version)."""
    now = {(spec.name, spec.version): spec for spec in running}
    then = {(spec.name, spec.version): spec for spec in wanted}
    changes = ModelChanges(
        add=[spec for key, spec in then.items() if key not in now],
        remove=[key for key in now if key not in then],
        reweigh=[],
        retune=[],
        kept=[],
    )
    for key in now.keys() & then.keys():
        old, new = now[key], then[key]
        if new.weight != old.weight:
            changes.reweigh.append(new)
        if any(getattr(new, name) != getattr(old, name) for name in RETUNABLE):
            changes.retune.append(new)
        rest = {"weight", *RETUNABLE}
        if dataclasses.replace(old, **{n: getattr(new, n) for n in rest}) != new:
            changes.kept.append(new.label)
    return changes
