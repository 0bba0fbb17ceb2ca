"""Pure rules for faults: when a batch call counts as hung, and what a failed batch becomes.

Inference is side-effect free, so running a request again is always safe; these rules only
bound how often. The pool and the batcher apply them; nothing here reads a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import BackendError
from .item import QueuedRequest


class FailureKind(enum.Enum):
    RAISED = "raised"
    """The batch function raised: some input may be poison, so halve and retry."""
    MALFORMED = "malformed"
    """It answered with something other than one str per input: retry once, whole."""
    HUNG = "hung"
    """It ran past its budget: the requests go to another device, once."""


@dataclass(frozen=True, slots=True)
class BatchFailure:
    kind: FailureKind
    error: BackendError
    device: str
    batch_id: int


@dataclass(frozen=True, slots=True)
class Recovery:
    """What becomes of a failed batch: groups to run again as they are, and those who fail."""

    retry: list[list[QueuedRequest]]
    fail: list[QueuedRequest]
    unpaid: bool = False
    """True when the retry budget, not the rules, made `fail` fail."""


@dataclass(slots=True)
class RetryBudget:
    """Caps the calls that retries add: `ratio` per first-try call, up to a `reserve`.

    Without a cap, a flood of poison inputs is a denial of service: isolating each one costs
    about 2 log2(batch size) calls, more than the devices have, and the retries, which run
    first, starve everyone else. With it, a rare poison input is isolated at once (the default
    reserve covers one in a full batch), and under a flood the batches it cannot pay for fail whole,
    as they would on a server without isolation. Hung batches always get their retry: a hang
    is the device's fault, not the requests'.
    """

    ratio: float = 0.25
    reserve: float = 30.0
    tokens: float = 30.0

    def on_first_try(self) -> None:
        self.tokens = min(self.reserve, self.tokens + self.ratio)

    def spend(self, calls: int) -> bool:
        if self.tokens < calls:
            return False
        self.tokens -= calls
        return True


def plan_recovery(
    batch: list[QueuedRequest], kind: FailureKind, *, bisect: bool, budget: RetryBudget
) -> Recovery:
    """Halving isolates each poison input in about log2(len(batch)) rounds; every other
    request then succeeds. Malformed and hung batches are run again once, whole: neither says
    which input is to blame, and a second failure is then the backend's, not bad luck's."""
    if kind is FailureKind.RAISED:
        if not bisect or len(batch) == 1:
            return Recovery([], list(batch))
        if not budget.spend(2):
            return Recovery([], list(batch), unpaid=True)
        middle = len(batch) // 2
        return Recovery([batch[:middle], batch[middle:]], [])
    if kind is FailureKind.MALFORMED:
        again = [r for r in batch if not r.malformed_retried]
        if again and not budget.spend(1):
            return Recovery([], list(batch), unpaid=True)
        for request in again:
            request.malformed_retried = True
    else:
        again = [r for r in batch if not r.hang_retried]
        for request in again:
            request.hang_retried = True
    fail = [r for r in batch if r not in again]  # QueuedRequest compares by identity
    return Recovery([again] if again else [], fail)


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


PROBE_INPUT = "batchserve-probe"
"""The one input of the batch that tests whether a device that hung answers again."""

MAX_PROBE_DELAY_S = 30.0
"""Probes start one budget after the hung call returns and back off, doubling, to this."""
