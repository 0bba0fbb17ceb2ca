"""The batch model versions of a serving engine, changed without a restart.

The admin door (PUT, PATCH and DELETE of `/admin/models/...`) and a reload (`--config` on
SIGHUP, `Engine.reconfigure`) drive the same `Versions`: it adds a version, loading it in the
background beside what serves; reweighs one; drains one and then unloads it and frees its
devices' memory; and retunes the batch limits a reload changes. It owns those loads and
unloads (a `TaskSet`); the registry, the pool and the batcher it changes are the engine's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import sys
from collections.abc import Callable
from typing import Any

from ..batcher import Batcher
from ..config import Config
from ..errors import BatchserveError, Conflict, InvalidInput, ModelNotFound, StartupError
from ..gpu_pool import GpuPool
from ..live_config import ModelChanges, model_changes
from ..models.registry import ModelVersion, Registry, VersionState, build_version
from ..models.specs import (
    BatchFn,
    DeviceFactory,
    ModelSpec,
    default_spec,
    load_models_file,
)
from ..observability.metrics import Metrics
from ..rules.policy import Policy, make_policy
from ..tasks import CrashHandler, TaskSet

log = logging.getLogger(__name__)


def starting_models(
    config: Config,
    models: list[ModelSpec] | None,
    *,
    fn: BatchFn | None,
    fn_per_device: DeviceFactory | None,
    devices: str | None,
    policy: Policy | None,
) -> tuple[list[ModelVersion], list[ModelSpec]]:
    """What an engine starts with (see Engine's arguments): its batch versions, built, and
    its generation models' specs."""
    if models is None and config.models is not None:
        models = load_models_file(config.models, config)
    from_flags = models is None
    if models is None:
        spec = default_spec(config)
        if devices is not None:
            spec = dataclasses.replace(spec, devices=devices)
        models = [spec]
    versions = [
        build_version(config, spec, fn=fn, fn_per_device=fn_per_device, policy=policy)
        if from_flags
        else build_version(config, spec)
        for spec in models
        if spec.generator is None
    ]
    return versions, [spec for spec in models if spec.generator is not None]


class Versions:
    def __init__(
        self,
        registry: Registry,
        pool: GpuPool,
        batcher: Batcher,
        metrics: Metrics | None,
        *,
        require_ready: Callable[[], None],
        on_crash: CrashHandler,
    ) -> None:
        """`require_ready` raises NotReady unless the engine serves: no version is added
        while it starts or drains."""
        self._registry = registry
        self._pool = pool
        self._batcher = batcher
        self._metrics = metrics
        self._require_ready = require_ready
        self._device_names = [device.name for device in pool.devices]
        self._changes = TaskSet(on_crash)
        """Loads and unloads of model versions asked for while serving."""

    def __repr__(self) -> str:
        return f"<Versions {self._registry!r} changing={len(self._changes)}>"

    def all_ready(self) -> None:
        """The engine has started: every version it started with takes traffic."""
        for version in self._registry:
            version.state = VersionState.READY

    def add(self, spec: ModelSpec, config: Config) -> dict[str, Any]:
        """Loads a new version in the background (beside what serves); it takes traffic
        once every device has loaded it and answered a warm-up batch."""
        self._require_ready()
        if spec.generator is not None:
            # Only batch models load while serving; built as one, it would ignore the field.
            raise InvalidInput(
                "field 'generator': a generation model cannot be added while serving; list it"
                " in --models and restart"
            )
        if self._registry.get(spec.name, spec.version) is not None:
            raise Conflict(f"{spec.label} exists; DELETE it first, or PATCH its weight")
        try:
            version = build_version(config, spec)
        except StartupError as exc:
            raise InvalidInput(str(exc)) from None
        foreign = sorted(set(version.device_names) - set(self._device_names))
        if foreign:
            raise InvalidInput(
                f"field 'devices': {', '.join(foreign)} is not a device of this server"
                f" ({', '.join(self._device_names)})"
            )
        self._registry.add(version)
        log.info("loading %s on %s", spec.label, ",".join(version.device_names))
        self._changes.start(self._load(version), name=f"batchserve-load-{spec.label}")
        return version.describe()

    async def _load(self, version: ModelVersion) -> None:
        problems = await self._pool.load(version, beside_serving=True)
        for problem in problems:
            log.error("%s", problem)
        if not version.loaded_on:
            self._registry.remove(version)
            log.error("%s loaded on no device and is not added", version.spec.label)
            return
        version.state = VersionState.READY
        log.info("%s is ready on %s and takes traffic", version.spec.label, version.loaded_on)

    def set_weight(self, name: str, version_name: str, weight: float) -> dict[str, Any]:
        version = self._existing(name, version_name)
        old = version.spec.weight
        version.spec = dataclasses.replace(version.spec, weight=weight)
        log.info("%s weight %s -> %s", version.spec.label, old, weight)
        return version.describe()

    def remove(self, name: str, version_name: str) -> dict[str, Any]:
        """Stops new traffic to a version at once; what it holds finishes, then it unloads
        and its devices' memory is freed."""
        version = self._existing(name, version_name)
        if version.state is VersionState.LOADING:
            raise Conflict(f"{version.spec.label} is still loading; delete it once ready")
        if version.state is VersionState.READY:
            version.state = VersionState.DRAINING
            log.info("draining %s: no new requests; those it holds finish", version.spec.label)
            self._changes.start(self._unload(version), name=f"batchserve-unload-{name}")
        return version.describe()

    async def _unload(self, version: ModelVersion) -> None:
        await self._batcher.wait_until(
            lambda _: not self._batcher.queued_for(version) and not self._pool.running(version)
        )
        self._pool.unload(version)
        self._registry.remove(version)
        # Its metric series go with it: add/delete cycles must not grow the scrape.
        self._batcher.forget(version.name, version.version)
        if self._metrics is not None:
            self._metrics.forget(version.name, version.version)
        await asyncio.to_thread(_free_device_memory)
        log.info("%s is unloaded", version.spec.label)

    def plan(self, config: Config) -> ModelChanges:
        """What a reload to `config` changes of the versions: those of its models file, else
        the running ones with its batch limits. A models file that does not load raises
        StartupError, before anything has changed."""
        if config.models is not None:
            specs = [s for s in load_models_file(config.models, config) if s.generator is None]
        else:
            specs = [
                dataclasses.replace(
                    version.spec,
                    max_batch_size=config.max_batch_size,
                    max_linger_ms=config.max_linger_ms,
                )
                for version in self._registry
            ]
        return model_changes([version.spec for version in self._registry], specs)

    def apply(self, models: ModelChanges, config: Config) -> None:
        """Retunes, reweighs, removes and adds versions as the admin API would; one that
        cannot be added or removed (still loading, a device this server lacks) is logged and
        the rest go on."""
        for spec in models.retune:
            version = self._existing(spec.name, spec.version)
            version.spec = dataclasses.replace(
                version.spec, max_batch_size=spec.max_batch_size, max_linger_ms=spec.max_linger_ms
            )
            version.policy = make_policy(
                config.policy, version.spec, config.max_linger_ms, version.estimate
            )
        for spec in models.reweigh:
            version = self._existing(spec.name, spec.version)
            version.spec = dataclasses.replace(version.spec, weight=spec.weight)
        for name, version_name in models.remove:
            _logged(self.remove, name, version_name)
        for spec in models.add:
            _logged(self.add, spec, config)

    def _existing(self, name: str, version_name: str) -> ModelVersion:
        version = self._registry.get(name, version_name)
        if version is None:
            raise ModelNotFound(f"no version {version_name[:64]!r} of model {name[:64]!r}")
        return version

    async def settled(self) -> None:
        """Returns once the loads and unloads under way have finished."""
        await self._changes.join()

    async def aclose(self) -> None:
        """Cancels the loads and unloads still under way and waits for them to end."""
        await self._changes.aclose()


def _logged(change: Callable[..., object], *args: Any) -> None:
    """One version added or removed by a reload; a refusal is logged and the reload goes on."""
    try:
        change(*args)
    except BatchserveError as error:
        log.error("the reload could not apply %s: %s", args[0], error)


def _free_device_memory() -> None:
    """After a version unloads: collect its weights, and give CUDA's cached blocks back
    where torch is loaded (other processes and the next version can then use them)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
