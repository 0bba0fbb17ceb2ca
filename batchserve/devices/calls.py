"""A batch call as the pool's `on_call` hears of it as it returns (tracing: its span)."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..batching.request import QueuedRequest


class BatchCall(NamedTuple):
    """A batch call that returned, as the pool's `on_call` hears of it (its trace span)."""

    batch: list[QueuedRequest]
    batch_id: int
    device: str
    started: float
    finished: float
    reason: str
    """Why the batch left (rules/policy.py's FlushReason)."""
    error: str | None
    """None: it answered its batch; else why not: the type of what it raised, or "hung"
    (the watchdog handed the batch on; the call returned late)."""


def error_type(returned: list[Any] | Exception) -> str | None:
    """What a call raised, by type only: its message may quote the inputs."""
    return type(returned).__name__ if isinstance(returned, Exception) else None
