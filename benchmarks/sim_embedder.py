"""A simulated embedding model for benchmarks/batch_api.py: a call takes COST as the
simulated backend's `--sim-cost` does (a fixed part plus a part per padded character:
batch size x longest input), and each vector is a function of its input alone, so a Batch
API line's answer can be checked against the same request sent online."""

from __future__ import annotations

import threading
import time

COST_S = (0.0005, 0.00005)
"""0.5 ms a call plus 50 us per padded character: --sim-cost 0.5,0.05 of the online model."""


class SimEmbedder:
    embedding_dim = 4

    def __init__(self, device: str) -> None:
        self._device = device
        self._busy = threading.Lock()

    def __call__(self, inputs: list[str]) -> list[list[float]]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{self._device} ran two embedding calls at once")
        try:
            fixed_s, per_char_s = COST_S
            time.sleep(fixed_s + per_char_s * len(inputs) * max(map(len, inputs)))
            return [
                [float(len(text)), float(text.count("a")), float(sum(map(ord, text)) % 997), 1.0]
                for text in inputs
            ]
        finally:
            self._busy.release()

    def count_tokens(self, text: str) -> int:
        return len(text.split())


def load(device: str) -> SimEmbedder:
    return SimEmbedder(device)
