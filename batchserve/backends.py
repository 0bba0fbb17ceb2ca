"""Where batch functions come from: the simulated default, or the user's own code.

Every backend is a `DeviceFactory`: called once per device, on that device's own thread, with
the device name ("sim:0", "cpu", "cuda:1"); it returns the batch function for that device.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable

from .errors import StartupError

BatchFn = Callable[[list[str]], list[str]]
DeviceFactory = Callable[[str], BatchFn]


def simulate(input_text: str) -> str:
    """The simulated model's documented output for one input: the input reversed."""
    return input_text[::-1]


class SimulatedDevice:
    """Honours the batch contract exactly, so the server is exercised as a real GPU would be.

    One call takes `latency_s` whatever the batch size; a concurrent call, an empty batch or one
    over `limit` raises, because a real device would be wedged or the model would reject it.
    """

    def __init__(self, device: str, latency_s: float, limit: int) -> None:
        self.device = device
        self._latency_s = latency_s
        self._limit = limit
        self._busy = threading.Lock()
        self.calls = 0

    def __call__(self, inputs: list[str]) -> list[str]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{self.device} was entered by two batch calls at once")
        try:
            if not 1 <= len(inputs) <= self._limit:
                raise ValueError(f"batch of {len(inputs)} inputs; the limit is 1 to {self._limit}")
            self.calls += 1
            time.sleep(self._latency_s)
            return [simulate(text) for text in inputs]
        finally:
            self._busy.release()

    def __repr__(self) -> str:
        return f"<SimulatedDevice {self.device} calls={self.calls}>"


def simulated_factory(latency_s: float, limit: int) -> DeviceFactory:
    def load(device: str) -> BatchFn:
        return SimulatedDevice(device, latency_s, limit)

    return load


def shared_fn_factory(path: str) -> DeviceFactory:
    """--fn: one batch function that every device calls."""
    fn = import_attr(path, "--fn")

    def load(device: str) -> BatchFn:
        return fn

    return load


def per_device_factory(path: str) -> DeviceFactory:
    """--fn-per-device: the user's factory, which loads weights once on each device."""
    factory = import_attr(path, "--fn-per-device")

    def load(device: str) -> BatchFn:
        fn = factory(device)
        if not callable(fn):
            raise StartupError(
                f"--fn-per-device {path} returned {type(fn).__name__} for {device},"
                " not a batch function"
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
