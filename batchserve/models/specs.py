"""What a server runs: the models file (`--models`), one entry per model version.

    [[model]]
    name = "reverse"            # required
    version = "1"               # required; several entries may share a name
    fn = "pkg.mod:attr"         # or fn_per_device = "pkg.mod:attr"; neither: simulated
                                # or generator = "pkg.mod:attr" (or "sim"): a generation model
    devices = "sim:2"           # as --devices; models may share devices
    max_batch_size = 100        # optional
    weight = 90                 # optional: share of this name's unpinned traffic
    cost = "length"             # optional: "flat" (default) or "length"
    max_batch_tokens = 8192     # optional, length models: batch size x longest input
    slo_ms = 300                # optional: derives the linger budget (see rules/policy.py)
    max_linger_ms = 20          # optional: overrides the derived linger budget
    model_path = "/models/x"    # optional: a generator's, or an fn_per_device's folder
    dimensions = [256, 128]     # optional, embedders: the Matryoshka sizes it was trained for

Without `--models`, the flags define one model named `default`, version "1". Every check
names the entry and the field, so a bad file fails start-up (or an admin PUT) with one line.
Pure: nothing here loads a model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from ..config import BACKEND_BATCH_LIMIT, DTYPES, Config, read_toml
from ..errors import StartupError

BatchFn = Callable[..., list[Any]]
"""A batch function: a list of inputs (and the request's params as keyword arguments) to a
list of outputs, one JSON value (usually a str) per input."""
DeviceFactory = Callable[[str], BatchFn]
"""Called once per device, on that device's thread, with its name; returns its batch fn."""

CostKind = Literal["flat", "length"]
DEFAULT_MODEL = "default"
DEFAULT_VERSION = "1"
MAX_NAME = 64


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    version: str
    fn: str | BatchFn | None = None
    """A path package.module:attr (a models file), or the function itself (Python)."""
    fn_per_device: str | DeviceFactory | None = None
    generator: str | Callable[[str], object] | None = None
    """A generation model's factory (see generators.py), "sim" for the simulated one;
    None: a batch model. What the factory returns is checked against the generator contract
    as it loads, so a spec does not name that contract (generators.py depends on specs)."""
    devices: str = "sim:4"
    max_batch_size: int = BACKEND_BATCH_LIMIT
    weight: float | None = None
    """None: an equal share with the name's other unweighted versions."""
    cost: CostKind = "flat"
    max_batch_tokens: int | None = None
    slo_ms: float | None = None
    max_linger_ms: float | None = None
    """None: derived from `slo_ms` when given, else the server's --max-linger-ms."""
    model_path: str | None = None
    """A generation model's local folder or GGUF file (None: the server's --model-path), or
    the folder an `fn_per_device` factory loads (passed to it as `model_path`)."""
    dtype: str | None = None
    """A generation model's dtype; None: the server's --dtype."""
    dimensions: tuple[int, ...] = ()
    """An embedder's Matryoshka sizes: a request may ask for one of these (or the full
    width), and gets its vectors cut to it and renormalised."""

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


class SpecError(ValueError):
    """One field of one entry is wrong; the message names both."""


_REQUIRED = ("name", "version")
_KINDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "version": (str,),
    "fn": (str,),
    "fn_per_device": (str,),
    "generator": (str,),
    "devices": (str,),
    "max_batch_size": (int,),
    "weight": (int, float),
    "cost": (str,),
    "max_batch_tokens": (int,),
    "slo_ms": (int, float),
    "max_linger_ms": (int, float),
    "model_path": (str,),
    "dtype": (str,),
    "dimensions": (list,),
}
FIELDS = frozenset(field.name for field in fields(ModelSpec))


def spec_from_fields(entry: Mapping[str, object], defaults: Config) -> ModelSpec:
    """A checked spec from one entry's fields; what it leaves out comes from the flags."""
    unknown = sorted(entry.keys() - FIELDS)
    if unknown:
        raise SpecError(f"unknown field {unknown[0]!r}; the fields are {', '.join(sorted(FIELDS))}")
    for name in _REQUIRED:
        if name not in entry:
            raise SpecError(f"field {name!r} is required")
    for name, value in entry.items():
        kinds = _KINDS[name]
        if isinstance(value, bool) or not isinstance(value, kinds):
            wanted = " or ".join("number" if k is float else k.__name__ for k in kinds[-1:])
            raise SpecError(f"field {name!r} must be a {wanted}, not {type(value).__name__}")
    values = dict(entry)
    values.setdefault("devices", defaults.devices)
    values.setdefault("max_batch_size", defaults.max_batch_size)
    if "dimensions" in values:
        values["dimensions"] = tuple(values["dimensions"])  # type: ignore[arg-type]
    spec = ModelSpec(**values)  # type: ignore[arg-type]
    _check(spec)
    return spec


def _check(spec: ModelSpec) -> None:
    rules: list[tuple[str, bool, str]] = [
        ("name", _plain(spec.name), f"must be 1 to {MAX_NAME} letters, digits or -_."),
        ("version", _plain(spec.version), f"must be 1 to {MAX_NAME} letters, digits or -_."),
        ("fn", spec.fn is None or spec.fn_per_device is None, "give fn or fn_per_device, not both"),
        (
            "generator",
            spec.generator is None or (spec.fn is None and spec.fn_per_device is None),
            "declares a generation model: give it or fn/fn_per_device, not both",
        ),
        (
            "max_batch_size",
            1 <= spec.max_batch_size <= BACKEND_BATCH_LIMIT,
            f"must be between 1 and {BACKEND_BATCH_LIMIT}",
        ),
        ("weight", spec.weight is None or _positive(spec.weight), "must be more than 0"),
        ("cost", spec.cost in ("flat", "length"), 'must be "flat" or "length"'),
        (
            "max_batch_tokens",
            spec.max_batch_tokens is None or spec.max_batch_tokens >= 1,
            "must be 1 or more",
        ),
        (
            "max_batch_tokens",
            spec.max_batch_tokens is None or spec.cost == "length",
            'needs cost = "length"',
        ),
        ("slo_ms", spec.slo_ms is None or _positive(spec.slo_ms), "must be more than 0"),
        (
            "dtype",
            spec.dtype is None or spec.dtype in DTYPES,
            f"must be one of {', '.join(DTYPES)}",
        ),
        (
            "dimensions",
            all(type(size) is int and size >= 1 for size in spec.dimensions),
            "must be a list of whole numbers of 1 or more",
        ),
        (
            "model_path",
            spec.model_path is None or spec.generator is not None or spec.fn_per_device is not None,
            "needs a generator or fn_per_device",
        ),
        (
            "max_linger_ms",
            spec.max_linger_ms is None
            or (math.isfinite(spec.max_linger_ms) and spec.max_linger_ms >= 0),
            "must be 0 or more",
        ),
    ]
    for field, ok, message in rules:
        if not ok:
            raise SpecError(f"field {field!r} {message}")


def _plain(text: str) -> bool:
    return 1 <= len(text) <= MAX_NAME and all(c.isalnum() or c in "-_." for c in text)


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def load_models_file(path: str, defaults: Config) -> list[ModelSpec]:
    """Every entry of a models file, checked; a StartupError names the entry and field."""
    document = read_toml(path, "--models")
    entries = document.get("model")
    if set(document) - {"model"} or not isinstance(entries, list) or not entries:
        raise StartupError(
            f"--models {path}: expected one or more [[model]] tables, and only those"
        )
    specs: list[ModelSpec] = []
    for index, entry in enumerate(entries, start=1):
        where = f"--models {path}: [[model]] entry {index}"
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            where += f" ({entry['name']}@{entry.get('version', '?')})"
        try:
            spec = spec_from_fields(entry, defaults)
        except SpecError as exc:
            raise StartupError(f"{where}: {exc}") from None
        if any(s.name == spec.name and s.version == spec.version for s in specs):
            raise StartupError(f"{where}: field 'version' repeats {spec.label}")
        specs.append(spec)
    return specs


def default_spec(config: Config) -> ModelSpec:
    """The one model the flags define when there is no models file."""
    return ModelSpec(
        name=DEFAULT_MODEL,
        version=DEFAULT_VERSION,
        fn=config.fn,
        fn_per_device=config.fn_per_device,
        generator=config.generator,
        devices=config.devices,
        max_batch_size=config.max_batch_size,
        max_linger_ms=config.max_linger_ms,
    )
