"""Submit, then poll: the status API's store of requests and, once they end, their answers.

Ids are per tenant: each is stored under (its tenant, its id), so another tenant's id
looks unknown, and a tenant can neither see nor squat the ids another uses. Unfinished
requests are never evicted (their clients will come back for them); finished ones are kept
for `ttl_s` and, when the store is full, the oldest finished go first. A store full of
unfinished requests refuses new ones rather than forget one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .item import Ticket
from .tenants import Tenant

Slot = tuple[str | None, str]
"""(the tenant's name, or None on a server without keys; the request id)."""


def slot(request_id: str, owner: Tenant | None) -> Slot:
    return (None if owner is None else owner.name, request_id)


class ResultStore:
    def __init__(self, *, capacity: int, ttl_s: float) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._pending: dict[Slot, Ticket] = {}
        self._finished: OrderedDict[Slot, tuple[float, dict[str, Any]]] = OrderedDict()
        """slot -> (finished at, answer), oldest first."""

    def __repr__(self) -> str:
        return f"<ResultStore pending={len(self._pending)} finished={len(self._finished)}>"

    def holds(self, request_id: str, owner: Tenant | None = None) -> bool:
        """Whether `owner` has a request of this id held (another tenant's does not count)."""
        key = slot(request_id, owner)
        return key in self._pending or key in self._finished

    def make_room(self, now: float) -> bool:
        """Drops what has expired, then the oldest finished if full; False if still full."""
        self._expire(now)
        if len(self._pending) + len(self._finished) >= self._capacity and self._finished:
            self._finished.popitem(last=False)
        return len(self._pending) + len(self._finished) < self._capacity

    def unfinished(self, request_id: str, owner: Tenant | None = None) -> Ticket | None:
        """The request's ticket while it runs, for a poll that waits on it; None once it has
        finished, and for an unknown id or another tenant's."""
        return self._pending.get(slot(request_id, owner))

    def add(self, ticket: Ticket, owner: Tenant | None = None) -> None:
        self._pending[slot(ticket.request_id, owner)] = ticket

    def finish(
        self, request_id: str, answer: dict[str, Any], now: float, owner: Tenant | None = None
    ) -> None:
        key = slot(request_id, owner)
        del self._pending[key]
        self._finished[key] = (now, answer)

    def get(
        self, request_id: str, now: float, owner: Tenant | None = None
    ) -> dict[str, Any] | None:
        """The request's state or answer; None if unknown, expired, or another tenant's."""
        self._expire(now)
        key = slot(request_id, owner)
        if (ticket := self._pending.get(key)) is not None:
            # Its answer is stored by the callback that runs as it finishes.
            running = ticket.status == "running"
            return {"request_id": request_id, "status": "running" if running else "queued"}
        if (finished := self._finished.get(key)) is not None:
            return finished[1]
        return None

    def _expire(self, now: float) -> None:
        while self._finished:
            key, (finished_at, _) = next(iter(self._finished.items()))
            if finished_at + self._ttl_s > now:
                return
            del self._finished[key]
