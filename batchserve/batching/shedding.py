"""Shedding: refusing at once (503) a request predicted to miss its deadline; and, apart
from shedding, a deadline shorter than one batch call (504: the client's, not the load's).

On only where tenants are configured (their tiers order who is shed first). The batcher
owns one `Shedding` and asks it at each arrival, with what the request would wait behind
and the capacity its version can count on; this module owns the arrival rates by tier.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import DeadlineTooShort, Overloaded
from ..rules.capacity import DecayedRate
from ..rules.fair_queue import predicted_wait_s
from ..rules.tenants import TIER_RANKS
from .request import QueuedRequest

ADMISSION_UTILIZATION = 0.9
"""The share of the measured capacity that shedding counts on: headroom for the policy's
holds, partly filled batches and error in the estimate."""


class Shedding:
    """Arrivals a second by tier rank, and the refusal of requests that would be late."""

    def __init__(self) -> None:
        self._tier_rates = [DecayedRate() for _ in TIER_RANKS]
        """Arrivals a second by tier rank: what higher tiers will claim of the capacity."""

    def __repr__(self) -> str:
        return f"<Shedding tiers={len(self._tier_rates)}>"

    def refuse_if_late(
        self,
        request: QueuedRequest,
        ahead: int,
        capacity_rps: float | None,
        drain_time_s: Callable[[], float],
    ) -> None:
        """Sheds a request predicted to miss its deadline behind the `ahead` requests that
        go before it: the lowest tiers first, since every higher tier's queued requests are
        ahead of theirs, and the higher tiers' new arrivals will take their share of the
        capacity meanwhile. Raises Overloaded; else counts the arrival.

        A deadline shorter than one call (`refuse_too_short`) is the client's, so that one
        tenant's impossible deadlines do not read as the server shedding load."""
        refuse_too_short(request)
        call_s = request.key.version.estimate.seconds
        budget_s = request.deadline - request.arrival
        if capacity_rps and call_s:  # else nothing measured yet: no grounds to refuse
            claimed = sum(
                rate.at(request.arrival) for rate in self._tier_rates[: request.tier_rank]
            )
            left = capacity_rps * ADMISSION_UTILIZATION - claimed
            wait_s = predicted_wait_s(ahead, left, call_s)
            if wait_s > budget_s:
                raise Overloaded(
                    f"predicted to wait {wait_s:.2f} s behind {ahead} requests, past its deadline",
                    retry_after_s=ahead / left if left > 0 else drain_time_s(),
                )
        self._tier_rates[request.tier_rank].add(request.arrival, 1)


def refuse_too_short(request: QueuedRequest) -> None:
    """A deadline shorter than one call could not be met on an idle server: 504
    DeadlineTooShort, never retried. Asked of online requests with shedding on, and of
    every Batch API line, which would otherwise wait and expire again and again."""
    call_s = request.key.version.estimate.seconds
    budget_s = request.deadline - request.arrival
    if call_s and call_s > budget_s:
        raise DeadlineTooShort(
            f"the deadline of {budget_s * 1e3:.3g} ms is shorter than one batch call here"
            f" (about {call_s * 1e3:.3g} ms): it can never be met"
        )
