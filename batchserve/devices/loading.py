"""Loading model versions onto devices: at start-up on each device's own thread (so weights
land where they run), beside serving on a thread of its own followed by a warm-up batch in
the device's turn, and again on a fresh thread when a failing device restarts. The pool
calls these; which devices take part is its choice."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

from ..errors import StartupError
from ..models.registry import ModelVersion
from ..models.specs import DEFAULT_MODEL, BatchFn
from .device import Device, run_checked
from .health import DeviceState

WARM_UP_INPUT = "batchserve warm-up"


async def load(
    devices: list[Device],
    version: ModelVersion,
    *,
    beside_serving: bool,
    changed: Callable[[Device], None],
) -> list[str]:
    """Calls `version`'s factory for each of `devices`; returns what failed. At start-up
    each load runs on its device's thread. `beside_serving` (a version added while serving)
    loads on a thread of its own, so that the versions already on the device keep serving
    meanwhile, then runs a warm-up batch of one input on the device's own thread, in its
    turn (`_warm_up`, which calls `changed` as it takes the device and as it leaves it
    idle: the batcher counts free devices); a device whose warm-up fails does not take the
    version."""
    loads: list[Awaitable[BatchFn]] = [
        _load_beside(version, d, changed)
        if beside_serving
        else d.thread.submit(version.factory, d.name)
        for d in devices
    ]
    loaded = await asyncio.gather(*loads, return_exceptions=True)
    problems: list[str] = []
    for device, fn in zip(devices, loaded, strict=True):
        if isinstance(fn, BaseException):
            cause = fn if isinstance(fn, StartupError) else f"{type(fn).__name__}: {fn}"
            what = "" if version.name == DEFAULT_MODEL else f" {version.spec.label}"
            problems.append(f"device {device.name} failed to load{what}: {cause}")
            continue
        if not version.loaded_on:
            version.learn(fn)
        device.fns[version] = fn
        version.loaded_on.append(device.name)
    return problems


def unload(devices: list[Device], version: ModelVersion) -> None:
    """Drops `version`'s batch functions, so that its weights can be freed."""
    for device in devices:
        device.fns.pop(version, None)
    version.loaded_on.clear()


async def reload(device: Device) -> str | None:
    """Calls each loaded version's factory again on the device's thread; what failed."""
    for version in list(device.fns):
        try:
            device.fns[version] = await device.thread.submit(version.factory, device.name)
        except Exception as exc:
            return f"{version.spec.label}: {type(exc).__name__}: {exc}"
    return None


async def _load_beside(
    version: ModelVersion, device: Device, changed: Callable[[Device], None]
) -> BatchFn:
    fn = await asyncio.to_thread(version.factory, device.name)
    await _warm_up(device, fn, changed)
    return fn


async def _warm_up(device: Device, fn: BatchFn, changed: Callable[[Device], None]) -> None:
    """One input through `fn` on the device's own thread, once the device is free and
    taken for it: never beside a batch (the backend contract is one call at a time), and
    never queued on the thread ahead of a batch whose budget would then run out. Raises
    StartupError if the call fails or the device leaves service first."""
    if not await device.take_turn():
        raise StartupError("the device left service before its warm-up batch")
    changed(device)
    try:
        run = functools.partial(run_checked, fn, None)
        await device.thread.submit(run, [WARM_UP_INPUT])
    except Exception as exc:
        raise StartupError(f"its warm-up batch failed: {type(exc).__name__}: {exc}") from None
    finally:
        if not device.hand_turn():
            device.state = DeviceState.IDLE
            changed(device)
