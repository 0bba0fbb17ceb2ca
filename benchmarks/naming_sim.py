"""The plain 100 ms simulated device, with a batch function whose error names every input
of its call: the worst case for what an error answer may leak, for poison_flood.py (an
answer naming another request's input counts as `leaked` in loadgen's summary)."""

from __future__ import annotations

from collections.abc import Callable

from batchserve.config import BACKEND_BATCH_LIMIT
from batchserve.models.backends import POISON_MARKER, simulated_factory

_plain = simulated_factory(0.100, BACKEND_BATCH_LIMIT)


def load(device: str) -> Callable[[list[str]], list[str]]:
    run = _plain(device)

    def named(inputs: list[str]) -> list[str]:
        if any(POISON_MARKER in text for text in inputs):
            raise ValueError(f"cannot run {inputs}")
        return run(inputs)

    return named
