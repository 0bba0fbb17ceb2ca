"""Where batch functions come from: the simulated default, or the user's own code.

Every backend is a `DeviceFactory`: called once per device, on that device's own thread, with
the device name ("sim:0", "cpu", "cuda:1"); it returns the batch function for that device.
"""

from __future__ import annotations

import functools
import importlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import BACKEND_BATCH_LIMIT, Config
from ..config import HANG_MARKER as HANG_MARKER  # declared beside the flags whose help names it
from ..config import POISON_MARKER as POISON_MARKER
from ..errors import StartupError
from .specs import DEFAULT_MODEL, BatchFn, DeviceFactory, ModelSpec


def simulate(input_text: str) -> str:
    """The simulated model's documented output for one input: the input reversed."""
    return input_text[::-1]


class SimulatedFault(RuntimeError):
    """A fault the chaos settings injected, or one that the poison marker asked for."""


@dataclass(frozen=True, kw_only=True)
class Chaos:
    """Fault injection for the simulated backend: each call draws one fate from these rates."""

    hang_rate: float = 0.0
    fail_rate: float = 0.0
    bad_output_rate: float = 0.0
    hang_s: float = 10.0
    seed: int = 0


class Hangs:
    """The simulated devices' hangs, shared by all of them: the hang marker wedges one call,
    then no other (`claim`).

    A wedged call (the marker's, or one the chaos rate drew) returns after its hang time or
    when released, whichever comes first: a test that hands its devices its own `Hangs`
    releases them once the watchdog has judged one, so the hang outlasts any stall of the
    loop, however slow the machine.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._used = False
        self._released = threading.Event()

    def claim(self, inputs: list[str]) -> bool:
        if not any(HANG_MARKER in text for text in inputs):
            return False
        with self._lock:
            first, self._used = not self._used, True
        return first

    def hold(self, hang_s: float) -> None:
        """The wedged call's wait (on its device's thread)."""
        self._released.wait(hang_s)

    def release(self) -> None:
        self._released.set()


class SimulatedDevice:
    """Honours the batch contract exactly, so the server is exercised as a real GPU would be.

    One call takes `latency_s` whatever the batch size, plus `per_token_s` for each padded
    token (batch size x longest input, in characters) when a length cost is set; a
    concurrent call, an empty batch or one
    over `limit` raises, because a real device would be wedged or the model would reject it.
    `chaos` injects the faults a real device shows: a call that raises, one that hangs, one
    that answers with an output missing.
    """

    def __init__(
        self,
        device: str,
        latency_s: float,
        limit: int,
        chaos: Chaos | None = None,
        hangs: Hangs | None = None,
        per_token_s: float = 0.0,
    ) -> None:
        self.device = device
        self._latency_s = latency_s
        self._per_token_s = per_token_s
        self._limit = limit
        self._chaos = chaos or Chaos()
        self._random = random.Random(f"{self._chaos.seed}:{device}")
        self._hangs = hangs or Hangs()
        self._busy = threading.Lock()
        self.calls = 0

    def __call__(self, inputs: list[str]) -> list[str]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{self.device} was entered by two batch calls at once")
        try:
            if not 1 <= len(inputs) <= self._limit:
                raise ValueError(f"batch of {len(inputs)} inputs; the limit is 1 to {self._limit}")
            self.calls += 1
            chaos, fate = self._chaos, self._random.random()
            padded = len(inputs) * max(map(len, inputs))
            if fate < chaos.hang_rate or self._hangs.claim(inputs):
                self._hangs.hold(chaos.hang_s)
            else:
                time.sleep(self._latency_s + self._per_token_s * padded)
            poisoned = [i for i, text in enumerate(inputs) if POISON_MARKER in text]
            if poisoned:
                raise SimulatedFault(f"input {poisoned[0]} of the batch carries the poison marker")
            fate -= chaos.hang_rate
            if 0 <= fate < chaos.fail_rate:
                raise SimulatedFault("injected batch failure")
            outputs = [simulate(text) for text in inputs]
            if 0 <= fate - chaos.fail_rate < chaos.bad_output_rate:
                return outputs[:-1]  # malformed: one output short
            return outputs
        finally:
            self._busy.release()

    def __repr__(self) -> str:
        return f"<SimulatedDevice {self.device} calls={self.calls}>"


def simulated_factory(
    latency_s: float,
    limit: int,
    chaos: Chaos | None = None,
    per_token_s: float = 0.0,
    hangs: Hangs | None = None,
) -> DeviceFactory:
    """Simulated devices sharing one `hangs` (pass one to release their hangs)."""
    hangs = hangs or Hangs()

    def load(device: str) -> BatchFn:
        return SimulatedDevice(device, latency_s, limit, chaos, hangs, per_token_s)

    return load


def device_factory(
    config: Config,
    spec: ModelSpec,
    device_names: list[str],
    *,
    fn: BatchFn | None = None,
    fn_per_device: DeviceFactory | None = None,
) -> DeviceFactory:
    """The backend to load on each of a model's devices: a function or factory handed over
    in Python, else the one its `fn` / `fn_per_device` names, else the simulated model."""
    if fn is not None and fn_per_device is not None:
        raise StartupError("give fn or fn_per_device, not both")
    fn_flag, factory_flag = (
        ("--fn", "--fn-per-device")
        if spec.name == DEFAULT_MODEL
        else (f"{spec.label} fn", f"{spec.label} fn_per_device")
    )
    if fn is None and spec.fn is not None:
        fn = spec.fn if callable(spec.fn) else import_attr(spec.fn, fn_flag)
    if fn is not None:
        shared = fn
        return lambda device: shared
    if fn_per_device is None and callable(spec.fn_per_device):
        fn_per_device = spec.fn_per_device
    if fn_per_device is not None:
        return _checked_factory(fn_per_device, getattr(fn_per_device, "__name__", "the factory"))
    if isinstance(spec.fn_per_device, str):
        factory = import_attr(spec.fn_per_device, factory_flag)
        if spec.model_path is not None:  # a factory of many models: this one's folder
            factory = functools.partial(factory, model_path=spec.model_path)
        return _checked_factory(factory, f"{factory_flag} {spec.fn_per_device}")
    if not all(name.startswith("sim:") for name in device_names):
        raise StartupError(
            f"--devices {spec.devices} needs a model: give --fn or --fn-per-device"
            " (the simulated backend runs on sim:N devices)"
        )
    chaos = Chaos(
        hang_rate=config.sim_hang_rate,
        fail_rate=config.sim_fail_rate,
        bad_output_rate=config.sim_bad_output_rate,
        hang_s=config.sim_hang_ms / 1e3,
        seed=config.sim_seed,
    )
    if config.sim_cost is None:
        return simulated_factory(config.sim_latency_ms / 1e3, BACKEND_BATCH_LIMIT, chaos)
    fixed_ms, per_token_ms = config.sim_cost
    return simulated_factory(fixed_ms / 1e3, BACKEND_BATCH_LIMIT, chaos, per_token_ms / 1e3)


def _checked_factory(factory: Callable[[str], object], name: str) -> DeviceFactory:
    """The user's factory, which loads weights once on each device; what it returns must be
    a batch function."""

    def load(device: str) -> BatchFn:
        fn = factory(device)
        if not callable(fn):
            raise StartupError(
                f"{name} returned {type(fn).__name__} for {device}, not a batch function"
            )
        return fn

    return load


def import_attr(path: str, flag: str) -> Callable[..., list[str]]:
    module_name, colon, attr_path = path.partition(":")
    if not colon or not module_name or not attr_path:
        raise StartupError(f"{flag} {path!r}: expected package.module:attribute")
    try:
        target: object = importlib.import_module(module_name)
    except Exception as exc:
        raise StartupError(
            f"{flag} {path}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from None
    for name in attr_path.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise StartupError(
                f"{flag} {path}: {module_name} has no attribute {attr_path}"
            ) from None
    if not callable(target):
        raise StartupError(f"{flag} {path}: {type(target).__name__} is not callable")
    return target
