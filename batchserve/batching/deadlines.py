"""Requests' deadlines: one timer for the earliest still waiting, not one a request.

A timer a request cost about 2.7 us on uvloop (arming it, cancelling it once answered, and
closing its handle), more than the rest of admission. Requests mostly arrive in deadline
order, the server's timeout after each arrival, so they wait in a deque in that order
behind a single timer; a request whose deadline falls before the last one added (a shorter
timeout of its own, a tier's) gets a timer of its own instead. Entries are weak references
and nothing else (each object a request keeps while it waits costs: benchmarks/README.md,
section 4), so an answered request is freed at once; answered ones leave the front at each
add, and the whole deque is swept of them whenever it has doubled since the last sweep, so
it holds little more than the requests still waiting whatever the timeout.
"""

from __future__ import annotations

import weakref
from collections import deque

from ..clock import Clock, Timer
from .request import QueuedRequest

MIN_SWEEP = 1024
"""The deque's length below which it is never swept (the front is dropped at each add)."""

_Entry = weakref.ref[QueuedRequest]


class Deadlines:
    """Answers each request 504 at its deadline unless it is answered before; the engine's."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._in_order: deque[_Entry] = deque()
        self._last_deadline = float("-inf")
        """The latest deadline added: the timer is never armed past one still to come."""
        self._sweep_at = MIN_SWEEP
        self._timer: Timer | None = None
        self._armed_for = 0.0

    def __repr__(self) -> str:
        return f"<Deadlines in_order={len(self._in_order)} armed={self._timer is not None}>"

    def __len__(self) -> int:
        """Entries held: the requests waiting in deadline order, and some answered ones."""
        return len(self._in_order)

    def add(self, request: QueuedRequest) -> Timer | None:
        """Arms `request`'s deadline. Returns the timer of its own that a deadline before the
        last one added gets, for the caller to cancel once the request is answered; None when
        it waits in order (nothing to cancel)."""
        deadline = request.deadline
        if deadline < self._last_deadline:
            return self._clock.call_at(deadline, request.expire)
        self._last_deadline = deadline
        in_order = self._in_order
        while in_order and not _waiting(in_order[0]):  # answered ones leave the front
            in_order.popleft()
        in_order.append(weakref.ref(request))
        if len(in_order) >= self._sweep_at:
            self._sweep()
        if self._timer is None:
            self._arm()
        return None

    def close(self) -> None:
        """Disarms the timer; for an engine that has answered every request."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._in_order.clear()

    def _arm(self) -> None:
        """For the first request, which is still waiting (`add` dropped the answered ones
        before it)."""
        first = self._in_order[0]()
        assert first is not None
        self._armed_for = first.deadline
        self._timer = self._clock.call_at(self._armed_for, self._fire)

    def _fire(self) -> None:
        self._timer = None
        # Due: whatever this timer was armed for, even if the loop's clock reads a shade
        # earlier, as a timer of its own would have fired for it.
        due = max(self._clock.time(), self._armed_for)
        in_order = self._in_order
        while in_order:
            request = in_order[0]()
            if request is not None and not request.future.done():
                if request.deadline > due:
                    break
                request.expire()
            in_order.popleft()
        if in_order:
            self._arm()

    def _sweep(self) -> None:
        self._in_order = deque(entry for entry in self._in_order if _waiting(entry))
        self._sweep_at = max(MIN_SWEEP, 2 * len(self._in_order))


def _waiting(entry: _Entry) -> bool:
    request = entry()
    return request is not None and not request.future.done()
