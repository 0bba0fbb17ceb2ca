"""What the devices can do, measured: the one batch-time estimate, and decayed event rates.

One `CallTime` is shared by everything that needs the batch time: the policy's spacing, the
watchdog's budget, shedding and the capacity metrics. Two averages with two weights used to
disagree about the same devices. Pure: time is passed in.
"""

from __future__ import annotations

import math

CALL_TIME_WEIGHT = 0.2
"""Each finished batch moves the estimate a fifth of the way: a few batches follow a real
change (a longer model, a slower device), one outlier does not."""


class CallTime:
    """The recent average duration of a successful batch call; None until one has finished."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def __repr__(self) -> str:
        return f"<CallTime seconds={self.seconds}>"

    def observe(self, duration_s: float) -> None:
        if self.seconds is None:
            self.seconds = duration_s
        else:
            self.seconds += CALL_TIME_WEIGHT * (duration_s - self.seconds)


class DecayedRate:
    """Events per second, exponentially decayed: an O(1) estimate of a recent rate."""

    def __init__(self, horizon_s: float = 2.0) -> None:
        self._horizon_s = horizon_s
        self._rate = 0.0
        self._updated = 0.0

    def add(self, now: float, count: int) -> None:
        self._rate = self.at(now) + count / self._horizon_s
        self._updated = now

    def at(self, now: float) -> float:
        return self._rate * math.exp(-(now - self._updated) / self._horizon_s)
