"""Simulated models for benchmarks/models.py that check every call they get: each input
starts with its model's name (loadgen --models puts it there), and a call carrying another
model's input raises, so a mixed batch would show as 500s in the results."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

LATENCY_S = 0.100


def _model(name: str) -> Callable[[str], Callable[[list[str]], list[str]]]:
    def load(device: str) -> Callable[[list[str]], list[str]]:
        busy = threading.Lock()

        def run(inputs: list[str]) -> list[str]:
            if not busy.acquire(blocking=False):
                raise RuntimeError(f"{device} ran two {name} calls at once")
            try:
                foreign = [text for text in inputs if not text.startswith(f"{name}|")]
                if foreign:
                    raise RuntimeError(f"a {name} call carried {foreign[0][:40]!r}")
                time.sleep(LATENCY_S)
                return [text[::-1] for text in inputs]
            finally:
                busy.release()

        return run

    return load


hot = _model("hot")
cold = _model("cold")
