"""What the devices can do, measured: the one batch-time estimate, the watchdog's budget
drawn from it, a generation device's prefill cost, decayed event rates, and the largest
batch a time allows (`most_within`).

One `CallTime` is shared by everything that needs the batch time: the policy's spacing, the
watchdog's budget, shedding and the capacity metrics. Two averages with two weights used to
disagree about the same devices. Pure: time is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


def most_within(
    predict: Callable[[int], float | None], least: int, most: int, seconds: float
) -> int:
    """The largest batch size from `least` to `most` predicted done within `seconds`, else
    `least`; a size `predict` cannot say counts as over. Predictions grow with the size, so
    by halving: a few predictions, not one a size."""
    low, high = least, most
    while low < high:
        middle = (low + high + 1) // 2
        predicted = predict(middle)
        if predicted is not None and predicted <= seconds:
            low = middle
        else:
            high = middle - 1
    return low


CALL_TIME_WEIGHT = 0.2
"""Each finished batch moves the estimate a fifth of the way: a few batches follow a real
change (a longer model, a slower device), one outlier does not."""


class CallTime:
    """The recent average duration of a successful batch call; None until one has finished.

    A flat model's calls cost the same whatever their inputs, so this one number predicts
    every call; `LengthCost` predicts from the batch's padded size."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} seconds={self.seconds}>"

    def observe(self, duration_s: float, padded_tokens: int = 0) -> None:
        if self.seconds is None:
            self.seconds = duration_s
        else:
            self.seconds += CALL_TIME_WEIGHT * (duration_s - self.seconds)

    def predict(self, padded_tokens: int) -> float | None:
        """How long a call over `padded_tokens` (batch size x longest input) should take."""
        return self.seconds


LENGTH_COST_DECAY = 0.98
"""Each call keeps 98 % of the fit's weight on the calls before it: about fifty calls carry
the estimate, so it follows a model that warms up or a device that slows."""


class LengthCost(CallTime):
    """Learns `time = a + b * padded_tokens` online, by least squares with decaying weights.

    Until the calls seen differ in size, or if the fit comes out with a negative slope or
    intercept, it predicts the plain average, as a flat model does."""

    def __init__(self) -> None:
        super().__init__()
        self._sums = [0.0] * 5  # weight, x, y, x*x, x*y

    def observe(self, duration_s: float, padded_tokens: int = 0) -> None:
        super().observe(duration_s)
        x, y = float(padded_tokens), duration_s
        self._sums = [
            LENGTH_COST_DECAY * total + term
            for total, term in zip(self._sums, (1.0, x, y, x * x, x * y), strict=True)
        ]

    def line(self) -> tuple[float, float] | None:
        """The fitted (a seconds, b seconds per padded token), or None before there is one."""
        weight, sx, sy, sxx, sxy = self._sums
        spread = weight * sxx - sx * sx
        if weight <= 0 or spread <= 1e-9 * max(1.0, sxx * weight):
            return None
        slope = (weight * sxy - sx * sy) / spread
        intercept = (sy - slope * sx) / weight
        if slope < 0 or intercept < 0:
            return None
        return intercept, slope

    def predict(self, padded_tokens: int) -> float | None:
        fitted = self.line()
        if fitted is None:
            return self.seconds
        return fitted[0] + fitted[1] * padded_tokens


class StepCost(LengthCost):
    """A generation step's time over the tokens it processes, for its hang budget.

    A line fitted to decode steps (a few tokens, bound by reading the weights) runs far below
    a long prefill's cost (bound by arithmetic), so past the largest step seen it predicts at
    least that step's time scaled by the tokens: a small step's time per token is the larger,
    so this errs long, and a heavy but healthy step is not taken for a hang."""

    def __init__(self) -> None:
        super().__init__()
        self._largest = (0, 0.0)
        """The tokens and seconds of the largest step seen."""

    def observe(self, duration_s: float, padded_tokens: int = 0) -> None:
        super().observe(duration_s, padded_tokens)
        if padded_tokens >= self._largest[0]:
            self._largest = (padded_tokens, duration_s)

    def predict(self, padded_tokens: int) -> float | None:
        predicted = super().predict(padded_tokens)
        tokens, seconds = self._largest
        if predicted is None or padded_tokens <= tokens or tokens == 0:
            return predicted
        return max(predicted, seconds * padded_tokens / tokens)


class PrefillCost(LengthCost):
    """A generation device's step time over the tokens it processes, fitted on the steps
    that carry prefill only: the first-token forecast's measure of how fast it prefills.

    Steps that only decode are left out: bound by reading the weights, not by arithmetic,
    their tokens cost several times less than a prompt's (StepCost's docstring) and would
    promise a prefill faster than the device does it."""

    def step_seconds(self, tokens: int) -> float | None:
        """One step of `tokens`: on the fitted line; before there is one (every step seen of
        one size, as a saturated device's full steps are), the mean step scaled by its
        tokens, for a step no larger (a smaller one's fixed cost is not scaled down, so this
        errs short); None beyond it, or before any step: no grounds to predict."""
        fitted = self.line()
        if fitted is not None:
            return fitted[0] + fitted[1] * tokens
        weight, tokens_sum, seconds_sum = self._sums[:3]
        if weight <= 0 or tokens_sum <= 0 or tokens * weight > tokens_sum * (1 + 1e-9):
            return None
        return seconds_sum / tokens_sum * tokens


@dataclass(slots=True)
class BatchBudget:
    """How long one batch call may run before its device counts as hung.

    A fixed budget when the operator gives one; otherwise `multiple` times the call's
    predicted time (its version's estimate), never below `floor_s`, and `unknown_s` until a
    call has been seen, since first calls may compile kernels or warm caches.
    """

    fixed_s: float | None = None
    multiple: float = 5.0
    floor_s: float = 1.0
    unknown_s: float = 10.0

    def seconds(self, predicted_s: float | None) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        if predicted_s is None:
            return self.unknown_s
        return max(self.floor_s, self.multiple * predicted_s)


class DecayedRate:
    """Events (or seconds of device time) per second, exponentially decayed: an O(1)
    estimate of a recent rate."""

    def __init__(self, horizon_s: float = 2.0) -> None:
        self._horizon_s = horizon_s
        self._rate = 0.0
        self._updated = 0.0

    def add(self, now: float, count: float) -> None:
        horizon_s = self._horizon_s  # at(now) inlined: called at every arrival
        self._rate = self._rate * math.exp((self._updated - now) / horizon_s) + count / horizon_s
        self._updated = now

    def at(self, now: float) -> float:
        return self._rate * math.exp(-(now - self._updated) / self._horizon_s)
