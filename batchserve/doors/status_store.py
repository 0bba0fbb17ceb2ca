"""Submit, then poll: the status API's store of requests and, once they end, their answers.

Ids are per tenant: each is stored under (its tenant, its id), so another tenant's id
looks unknown, and a tenant can neither see nor squat the ids another uses. Unfinished
requests are never evicted (their clients will come back for them); finished ones are kept
for `ttl_s` and, when the store is full, the oldest finished go first. Full means `capacity`
requests or `max_bytes` bytes (an unfinished request counts its input, a finished one its
answer as JSON). A store full of unfinished requests refuses new ones rather than forget one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson

from ..batching.request import Ticket
from ..rules.tenants import Tenant

Slot = tuple[str | None, str]
"""(the tenant's id scope, its name unless the gateway shares it; or None for requests
without a tenant; the request id)."""


def slot(request_id: str, owner: Tenant | None) -> Slot:
    return (None if owner is None else owner.id_scope, request_id)


class ResultStore:
    def __init__(self, *, capacity: int, ttl_s: float, max_bytes: int = 1 << 62) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._max_bytes = max_bytes
        self._pending: dict[Slot, tuple[Ticket, int]] = {}
        """slot -> (ticket, its input's bytes)."""
        self._finished: OrderedDict[Slot, tuple[float, dict[str, Any], int]] = OrderedDict()
        """slot -> (finished at, answer, its bytes), oldest first."""
        self.bytes = 0
        """What the held inputs and answers take."""

    def __repr__(self) -> str:
        return (
            f"<ResultStore pending={len(self._pending)} finished={len(self._finished)}"
            f" bytes={self.bytes}>"
        )

    def holds(self, request_id: str, owner: Tenant | None = None) -> bool:
        """Whether `owner` has a request of this id held (another tenant's does not count)."""
        key = slot(request_id, owner)
        return key in self._pending or key in self._finished

    def make_room(self, now: float, size: int = 0) -> bool:
        """Drops what has expired, then the oldest finished while one more request (of
        `size` bytes) would not fit; False if it still would not (the unfinished fill it)."""
        self._expire(now)
        while self._finished and not self._fits(size):
            self._drop_oldest()
        return self._fits(size)

    def _fits(self, size: int) -> bool:
        count = len(self._pending) + len(self._finished)
        return count < self._capacity and self.bytes + size <= self._max_bytes

    def _drop_oldest(self) -> None:
        self.bytes -= self._finished.popitem(last=False)[1][2]

    def unfinished(self, request_id: str, owner: Tenant | None = None) -> Ticket | None:
        """The request's ticket while it runs, for a poll that waits on it; None once it has
        finished, and for an unknown id or another tenant's."""
        held = self._pending.get(slot(request_id, owner))
        return None if held is None else held[0]

    def add(self, ticket: Ticket, owner: Tenant | None = None, size: int = 0) -> None:
        """Holds a request whose input takes `size` bytes (`make_room` made room for it)."""
        self._pending[slot(ticket.request_id, owner)] = (ticket, size)
        self.bytes += size

    def finish(
        self, request_id: str, answer: dict[str, Any], now: float, owner: Tenant | None = None
    ) -> None:
        """Keeps the answer in place of the input; an answer bigger than its input may push
        out the oldest finished ones (never an unfinished one, nor this one)."""
        key = slot(request_id, owner)
        _, input_size = self._pending.pop(key)
        size = len(orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY))
        self.bytes += size - input_size
        while self._finished and self.bytes > self._max_bytes:
            self._drop_oldest()
        self._finished[key] = (now, answer, size)

    def get(
        self, request_id: str, now: float, owner: Tenant | None = None
    ) -> dict[str, Any] | None:
        """The request's state or answer; None if unknown, expired, or another tenant's."""
        self._expire(now)
        key = slot(request_id, owner)
        if (held := self._pending.get(key)) is not None:
            # Its answer is stored by the callback that runs as it finishes; until then one
            # that has just finished still reads as running, never as queued again.
            running = held[0].status != "queued"
            return {"request_id": request_id, "status": "running" if running else "queued"}
        if (finished := self._finished.get(key)) is not None:
            return finished[1]
        return None

    def _expire(self, now: float) -> None:
        while self._finished:
            finished_at = next(iter(self._finished.values()))[0]
            if finished_at + self._ttl_s > now:
                return
            self._drop_oldest()
