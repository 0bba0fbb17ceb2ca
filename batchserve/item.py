"""What travels from the HTTP handler through the batcher to a device, and back."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import NamedTuple


class Result(NamedTuple):
    """A request's answer; a tuple because a batch makes a hundred at once on the loop."""

    output: str
    queue_s: float
    compute_s: float
    batch_size: int
    batch_id: int
    device: str


@dataclass(slots=True, eq=False)
class QueuedRequest:
    """One accepted request; its future is resolved exactly once, by whoever gets there first.

    The handler owns the future (it created it and awaits it); the pool or the batcher only
    resolve it, and always check `done()` first, because a timeout or a client disconnect may
    already have cancelled it. The retry flags let a fault send it round again only once.
    """

    request_id: str
    input: str
    arrival: float
    deadline: float
    future: asyncio.Future[Result]
    tenant: str = ""
    tier_rank: int = 0
    tenant_weight: float = 1.0
    """Batch order: see fair_queue.py. Without API keys, one tenant at the top rank."""
    malformed_retried: bool = False
    hang_retried: bool = False
    running: bool = False
    """Set when a batch carrying it starts on a device (for the status API)."""
