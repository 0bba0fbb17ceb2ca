"""How big a batch may be while other tenants send to its model: pure, `now` passed in.

One tenant's long list (a 10,000-input /embed) fills every batch to the model's largest. A
second tenant's input that arrives meanwhile waits for the batch running, then rides in the
next full one: two full batches, where alone it pays one short call. While a tenant other
than the one whose request is oldest in a lane has sent to the version lately, that lane's
batches are cut to `ratio` times the predicted time of a one-input batch, so the newcomer
waits for short calls instead. A call's fixed cost is at most one input's time, so a batch
of `ratio` one-input times spends at least about 1 - 1/ratio of its time on the inputs'
own cost: the list keeps about that share of its full-batch rate at worst. Where the batch
time hardly grows with its size (a GPU), the cut rarely binds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .capacity import most_within

PRESENT_S = 1.0
"""A tenant that sent within this long counts as sending: one that sends every second or
more often has the batches cut for all of its requests, a rarer one from its arrival on."""


class Senders:
    """Who sent to one model version lately: the last tenant and when, and the last arrival
    of any other tenant. Two times, whatever the number of tenants, and enough to say for any
    tenant when another last sent."""

    __slots__ = ("_last", "_last_at", "_other_at")

    def __init__(self) -> None:
        self._last: str | None = None
        self._last_at = -math.inf
        self._other_at = -math.inf
        """The last arrival of a tenant other than `_last`."""

    def __repr__(self) -> str:
        return f"<Senders last={self._last!r} at={self._last_at} other_at={self._other_at}>"

    def heard(self, tenant: str, at: float) -> None:
        if tenant == self._last:
            self._last_at = max(self._last_at, at)
            return
        self._other_at, self._last, self._last_at = self._last_at, tenant, at

    def other_since(self, tenant: str, since: float) -> bool:
        """Whether a tenant other than `tenant` sent at `since` or later."""
        return (self._other_at if tenant == self._last else self._last_at) >= since


def shared_count(count: int, ratio: float, predict: Callable[[int], float | None] | None) -> int:
    """How many of `count` requests a batch takes while others send: the most whose
    predicted time is at most `ratio` times one request's, and at least `ratio` (whole)
    of them, which fit whatever the call's fixed cost. `predict` None: the cost of a size is
    not learned yet, so only those. All `count` where the time does not grow with the size
    (a flat model's), or with `ratio` 0 (the cut turned off)."""
    if ratio <= 0:
        return count
    low = min(count, max(1, math.floor(ratio)))  # ratio x one input's time, at any fixed cost
    one = None if predict is None else predict(1)
    if predict is None or one is None:
        return low
    return most_within(predict, low, count, ratio * one)
