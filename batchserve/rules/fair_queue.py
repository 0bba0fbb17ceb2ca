"""The waiting requests, in the order batches take them: by tier, fair between tenants.

Each place in a batch goes to the tier whose oldest request has the earliest *priority time*:
its arrival plus `aging_s` for each tier it is below enterprise. Enterprise goes first, but a
free request that has waited 2 x `aging_s` longer than the oldest enterprise one goes before
it: lower tiers are delayed, never starved. Inside the chosen tier the tenants take turns by
deficit round robin: each turn adds the tenant's weight (1 unless its key says otherwise) to
its credit, and it sends one request per whole unit of credit, so a tenant with 10,000 queued
requests cannot push another tenant's request out of the next batch. Without API keys every
request belongs to one tenant and this is plain first-in, first-out. The Batch API's lines
wait in IDLE_RANK, below every tier and never aged: they are taken only when no online
request waits here. Pure: nothing here reads a clock.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from .tenants import IDLE_RANK


class Waiting(Protocol):
    """What the queue reads of a waiting request: a batch request or a generation."""

    @property
    def request_id(self) -> str: ...
    @property
    def arrival(self) -> float: ...
    @property
    def tenant(self) -> str: ...
    @property
    def tier_rank(self) -> int: ...
    @property
    def tenant_weight(self) -> float: ...


Request = TypeVar("Request", bound=Waiting)
Turn = tuple[str, int]
"""Who takes turns: a tenant in a tier. A tenant's requests may come in several tiers (the
inference gateway's objective header sets each request's), and each waits in its own."""


class FairQueue(Generic[Request]):
    def __init__(self, aging_s: float = 1.0) -> None:
        self.aging_s = aging_s
        # Keyed by the requests themselves, not their ids: ids are the tenants' own, so two
        # tenants' requests (or a request and an embedding's part) may share one.
        self._by_arrival: dict[Request, None] = {}
        self._tenants: dict[Turn, dict[Request, None]] = {}
        self._turns: list[deque[Turn]] = [deque() for _ in range(IDLE_RANK + 1)]
        """Per tier rank, the tenants with requests waiting, in round-robin order."""
        self.idle = 0
        """Batch API lines waiting here (IDLE_RANK)."""
        self._weight: dict[Turn, float] = {}
        self._credit: dict[Turn, float] = {}
        self.weight = 0.0
        """The weights of the tenants waiting here, summed: the queue's claim on device
        time against other queues, so fairness between tenants counts device time."""

    def __len__(self) -> int:
        return len(self._by_arrival)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._by_arrival))

    def __repr__(self) -> str:
        return f"<FairQueue requests={len(self)} tenants={len(self._tenants)}>"

    def push(self, request: Request) -> None:
        self._by_arrival[request] = None
        turn = request.tenant, request.tier_rank  # inline: every request's push
        waiting = self._tenants.get(turn)
        if waiting is None:
            waiting = self._tenants[turn] = {}
            self._weight[turn] = request.tenant_weight
            self.weight += request.tenant_weight
            self._credit[turn] = 0.0
            self._turns[request.tier_rank].append(turn)
        waiting[request] = None
        self.idle += request.tier_rank == IDLE_RANK

    def discard(self, request: Request) -> bool:
        """Removes a queued request; False if it was not here (taken, or never queued)."""
        if request not in self._by_arrival:
            return False
        del self._by_arrival[request]
        self._forget(request)
        return True

    def clear(self) -> None:
        self._by_arrival.clear()
        self._tenants.clear()
        self._weight.clear()
        self._credit.clear()
        self.weight = 0.0
        self.idle = 0
        for turns in self._turns:
            turns.clear()

    def only(self, tenant: str) -> bool:
        """Whether every request waiting here is `tenant`'s (True when none waits)."""
        return all(name == tenant for name, _ in self._tenants)

    def head(self, count: int) -> list[Request]:
        """The oldest `count` requests: what the policy judges urgency by."""
        return list(itertools.islice(self._by_arrival, count))

    def take(self, count: int) -> list[Request]:
        """Up to `count` requests in batch order (see the module docstring)."""
        if len(self._tenants) == 1:
            return self._take_from_sole_tenant(count)
        batch: list[Request] = []
        while len(batch) < count and (turns := self._next_tier()) is not None:
            tenant = turns[0]
            if self._credit[tenant] < 1:
                self._credit[tenant] += self._weight[tenant]
                if self._credit[tenant] < 1:
                    turns.rotate(-1)  # a weight under 1 sends only every few turns
                    continue
            waiting = self._tenants[tenant]
            request = next(iter(waiting))
            del waiting[request], self._by_arrival[request]
            self.idle -= request.tier_rank == IDLE_RANK
            batch.append(request)
            self._credit[tenant] -= 1
            if not waiting:
                turns.popleft()
                self._drop_tenant(tenant)
            elif self._credit[tenant] < 1:
                turns.rotate(-1)
        return batch

    def _take_from_sole_tenant(self, count: int) -> list[Request]:
        """One tenant waits (always so without API keys): its oldest `count`, with no turns
        to take; like a round that empties a queue, this leaves it no credit."""
        tenant, waiting = next(iter(self._tenants.items()))
        batch = list(itertools.islice(waiting, count))
        by_arrival = self._by_arrival
        for request in batch:
            del waiting[request], by_arrival[request]
        if tenant[1] == IDLE_RANK:
            self.idle -= len(batch)
        if waiting:
            self._credit[tenant] = 0.0
        else:
            self._turns[tenant[1]].clear()
            self._drop_tenant(tenant)
        return batch

    def _next_tier(self) -> deque[Turn] | None:
        best: tuple[float, deque[Turn]] | None = None
        for rank, turns in enumerate(self._turns[:IDLE_RANK]):
            if not turns:
                continue
            oldest = min(next(iter(self._tenants[t])).arrival for t in turns)
            priority_time = oldest + rank * self.aging_s
            if best is None or priority_time < best[0]:
                best = (priority_time, turns)
        if best is None:  # nothing online waits: the idle lines' turn
            return self._turns[IDLE_RANK] or None
        return best[1]

    def ahead_of(self, tenant: str, tier_rank: int, weight: float = 1.0) -> int:
        """How many queued requests a new one from `tenant` would wait behind: every higher
        tier's, and in its own tier each other tenant's share of the turns until its own."""
        ahead = sum(len(self._tenants[t]) for rank in range(tier_rank) for t in self._turns[rank])
        turns_needed = (len(self._tenants.get((tenant, tier_rank), ())) + 1) / weight
        return ahead + sum(
            min(len(self._tenants[t]), math.ceil(turns_needed * self._weight[t]))
            for t in self._turns[tier_rank]
        )

    def _forget(self, request: Request) -> None:
        self.idle -= request.tier_rank == IDLE_RANK
        turn = request.tenant, request.tier_rank
        waiting = self._tenants[turn]
        del waiting[request]
        if not waiting:
            self._turns[request.tier_rank].remove(turn)
            self._drop_tenant(turn)

    def _drop_tenant(self, turn: Turn) -> None:
        self.weight -= self._weight[turn]
        del self._tenants[turn], self._weight[turn], self._credit[turn]


def predicted_wait_s(ahead: int, capacity_rps: float, call_s: float) -> float:
    """Time until a request with `ahead` requests before it has its answer: never, if
    nothing is left of the capacity for it."""
    return ahead / capacity_rps + call_s if capacity_rps > 0 else math.inf
