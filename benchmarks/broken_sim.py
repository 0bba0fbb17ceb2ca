"""A simulated device that breaks: for benchmarks/chaos.py's failing-device scenario.

`sim:0`, as first loaded, raises on every call from `BREAKS_AFTER_S` after its load on (a
GPU that fell off the bus, a corrupted context); loaded again (a restart), it works. Every
other device, and every later load, is the plain 100 ms simulated device.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from batchserve.config import BACKEND_BATCH_LIMIT
from batchserve.models.backends import simulated_factory

BREAKS_AFTER_S = 5.0
BROKEN = "sim:0"

_plain = simulated_factory(0.100, BACKEND_BATCH_LIMIT)
_loads: Counter[str] = Counter()


def load(device: str) -> Callable[[list[str]], list[str]]:
    _loads[device] += 1
    run = _plain(device)
    if device != BROKEN or _loads[device] > 1:
        return run
    breaks_at = time.monotonic() + BREAKS_AFTER_S

    def broken(inputs: list[str]) -> list[str]:
        if time.monotonic() >= breaks_at:
            time.sleep(0.010)  # fails fast, as a lost device does
            raise RuntimeError(f"{device} fell off the bus")
        return run(inputs)

    return broken
