"""Submit, then poll: the status API's store of requests and, once they end, their answers.

Unfinished requests are never evicted (their clients will come back for them); finished ones
are kept for `ttl_s` and, when the store is full, the oldest finished go first. A store full
of unfinished requests refuses new ones rather than forget one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .item import Ticket
from .tenants import Tenant


class ResultStore:
    def __init__(self, *, capacity: int, ttl_s: float) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._pending: dict[str, Ticket] = {}
        self._finished: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        """request id -> (finished at, answer), oldest first."""
        self._owners: dict[str, Tenant | None] = {}

    def __repr__(self) -> str:
        return f"<ResultStore pending={len(self._pending)} finished={len(self._finished)}>"

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending or request_id in self._finished

    def make_room(self, now: float) -> bool:
        """Drops what has expired, then the oldest finished if full; False if still full."""
        self._expire(now)
        if len(self._pending) + len(self._finished) >= self._capacity and self._finished:
            self._owners.pop(self._finished.popitem(last=False)[0], None)
        return len(self._pending) + len(self._finished) < self._capacity

    def unfinished(self, request_id: str, owner: Tenant | None = None) -> Ticket | None:
        """The request's ticket while it runs, for a poll that waits on it; None once it has
        finished, and for an unknown id or another tenant's."""
        ticket = self._pending.get(request_id)
        if ticket is None or self._owners[request_id] != owner:
            return None
        return ticket

    def add(self, ticket: Ticket, owner: Tenant | None = None) -> None:
        self._pending[ticket.request_id] = ticket
        self._owners[ticket.request_id] = owner

    def finish(self, request_id: str, answer: dict[str, Any], now: float) -> None:
        del self._pending[request_id]
        self._finished[request_id] = (now, answer)

    def get(
        self, request_id: str, now: float, owner: Tenant | None = None
    ) -> dict[str, Any] | None:
        """The request's state or answer; None if unknown, expired, or another tenant's."""
        self._expire(now)
        if request_id in self._owners and self._owners[request_id] != owner:
            return None
        if (ticket := self._pending.get(request_id)) is not None:
            # Its answer is stored by the callback that runs as it finishes.
            running = ticket.status == "running"
            return {"request_id": request_id, "status": "running" if running else "queued"}
        if (finished := self._finished.get(request_id)) is not None:
            return finished[1]
        return None

    def _expire(self, now: float) -> None:
        while self._finished:
            request_id, (finished_at, _) = next(iter(self._finished.items()))
            if finished_at + self._ttl_s > now:
                return
            del self._finished[request_id]
            del self._owners[request_id]
