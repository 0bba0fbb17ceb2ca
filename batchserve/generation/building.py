"""A generation model built from its spec and the settings: its devices checked against its
generator (a real model never on the simulated devices), and the factory each device loads
it with. Apart from `models.py`, which holds the model once built."""

from __future__ import annotations

from ..clock import Clock
from ..config import Config
from ..devices.fleet import Devices
from ..errors import StartupError
from ..models.device_names import parse_devices
from ..models.generators import (
    SIM,
    GeneratorSettings,
    generator_factory,
    simulated_generator_factory,
)
from ..models.specs import DEFAULT_MODEL, ModelSpec
from ..rules.capacity import BatchBudget
from ..tasks import CrashHandler
from .models import GenerationModel


def build_generation_model(
    config: Config, spec: ModelSpec, *, clock: Clock, on_crash: CrashHandler, devices: Devices
) -> GenerationModel:
    """A generation model ready to load: its devices and the factory that loads each."""
    assert spec.generator is not None
    try:
        names = parse_devices(spec.devices)
    except StartupError as exc:
        raise StartupError(f"generator {spec.label}: {exc}") from None
    flag = "--generator" if spec.name == DEFAULT_MODEL else f"{spec.label} generator"
    if spec.generator == SIM and not all(name.startswith("sim:") for name in names):
        raise StartupError(
            f"{flag} sim runs on sim:N devices, not {spec.devices}; name a generator"
            " (e.g. batchserve.models.tiny_gpt:load) for real devices"
        )
    if (
        isinstance(spec.generator, str)
        and spec.generator != SIM
        and any(name.startswith("sim:") for name in names)
    ):
        where = (
            "add --devices cpu (or --devices cuda); sim:4, the default, is for the simulated"
            " backend"
            if spec.name == DEFAULT_MODEL
            else 'give it devices = "cpu" (or "cuda")'
        )
        raise StartupError(
            f"{flag} {spec.generator} loads a real model, which cannot run on the simulated"
            f" devices {spec.devices}: {where}"
        )
    fixed_ms, per_token_ms = config.sim_step_ms
    simulated = simulated_generator_factory(
        fixed_s=fixed_ms / 1e3,
        per_token_s=per_token_ms / 1e3,
        kv_budget_tokens=config.sim_kv_budget,
        fail_rate=config.sim_fail_rate,
        hang_s=config.sim_hang_ms / 1e3,
        seed=config.sim_seed,
    )
    settings = GeneratorSettings(
        model_path=spec.model_path or config.model_path,
        dtype=spec.dtype or config.dtype,
        kv_cache_bytes=config.kv_cache_bytes,
        weights_cache=config.weights_cache,
        prefix_caching=config.prefix_caching,
        cpu_threads=config.cpu_threads,
        compile_layers=config.compile_layers,
    )
    return GenerationModel(
        spec,
        generator_factory(spec.generator, flag, simulated, settings),
        names,
        devices=devices,
        clock=clock,
        mode=config.generate_mode,
        step_budget=BatchBudget(fixed_s=config.batch_timeout_ms / 1e3 or None),
        step_tokens=(config.step_tokens, config.prefill_step_tokens),
        on_crash=on_crash,
        grammar_cache=(config.grammar_cache_size, config.grammar_compile_timeout_ms / 1e3),
    )
