"""Pure rules for faults: what a failed batch becomes (when a call counts as hung follows
from its predicted time: `capacity.BatchBudget`).

Inference is side-effect free, so running a request again is always safe; these rules only
bound how often. The pool and the batcher apply them; nothing here reads a clock.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from ..errors import BackendError
from .request import QueuedRequest


class FailureKind(enum.Enum):
    RAISED = "raised"
    """The batch function raised: some input may be poison, so halve and retry."""
    MALFORMED = "malformed"
    """It answered with something other than one str per input: retry once, whole."""
    HUNG = "hung"
    """It ran past its budget: the requests go to another device, once."""
    DEVICE_FAILING = "device_failing"
    """Its device kept failing calls on different inputs and is restarting: the requests go
    to another device, once, as for a hang."""
    SUSPECT_DEVICE = "suspect_device"
    """Its device failed its last first try too: the requests go to another
    device, once and whole, while a probe tests the device; failing again, they split."""


@dataclass(frozen=True, slots=True)
class BatchFailure:
    kind: FailureKind
    error: BackendError
    """The whole story, for the log, and for a request that failed alone: only its own
    input was in the call."""
    device: str
    batch_id: int
    shared_error: BackendError | None = None
    """What a request gets when the failed call held other requests too: the batch
    function's message may name their inputs, so it goes to the log only. None: `error`
    is the server's own words and safe to share."""

    def answer_for(self, group: list[QueuedRequest]) -> BackendError:
        """The error to answer each of `group`, the requests failed together, with."""
        if len(group) > 1 and self.shared_error is not None:
            return self.shared_error
        return self.error


@dataclass(frozen=True, slots=True)
class Recovery:
    """What becomes of a failed batch: groups to run again as they are, and those who fail.

    `retry` groups are paid for by the retry budget and run before anything new; `spare`
    ones, which the budget could not pay for, run only on a device that has no full first-try
    batch to take, so rescue never takes device time from fresh work but never leaves a
    device idle either."""

    retry: list[list[QueuedRequest]]
    fail: list[QueuedRequest]
    spare: list[list[QueuedRequest]] = field(default_factory=list)


@dataclass(slots=True)
class RetryBudget:
    """Caps the calls that retries take from fresh work: `ratio` per first-try call, up to a
    `reserve`.

    Without a cap, a flood of poison inputs is a denial of service: isolating each one costs
    several calls, and retries that ran first would starve everyone else. With it, a rare
    poison input is isolated at once (the default reserve covers one in a full batch), and
    under a flood what it cannot pay for waits for spare device time. Hung batches always get
    their retry: a hang is the device's fault, not the requests'.
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
    batch: list[QueuedRequest],
    kind: FailureKind,
    *,
    bisect: bool,
    budget: RetryBudget,
    parts: int = 2,
    unproven: bool = False,
    known_poison: bool = False,
    ride: bool = False,
) -> Recovery:
    """A raised batch that held several tenants' requests is first split by tenant. One of
    a single tenant is split into `parts` (at least 2: one per free device), so each poison
    input stands alone after about log_parts(len(batch)) rounds and every other request then
    succeeds. A lone input that raised is poison once it has failed on a second device too,
    or where no other device can run it; until then (`unproven`) its device may be to blame
    (a broken device fails every input), and it runs once more, on another device. Repeats
    of a remembered poison input (`known_poison`) batched together fail together, at once.
    Malformed and hung batches (and those of a failing device) are run again once, whole:
    neither says which input is to blame, and a second failure is then the backend's. So is
    the batch of a suspect device, which then fails as a raised batch if it fails again."""
    if kind is FailureKind.SUSPECT_DEVICE:
        if not any(request.moved for request in batch):
            for request in batch:
                request.moved = True
            return Recovery([list(batch)], [])
        kind = FailureKind.RAISED
    if kind is FailureKind.RAISED:
        if known_poison:  # repeats of one remembered poison input, and nothing else
            return Recovery([], list(batch))
        if len(batch) == 1:
            [request] = batch
            if unproven and not request.device_retried:
                request.device_retried = True
                return Recovery([batch], [])
            return Recovery([], list(batch))
        if len(tenants := by_tenant(batch)) > 1:
            # One tenant's failures must not fail another's requests, nor cost them more
            # than one call again: each tenant's part runs again alone and before anything
            # new, unpaid, whatever the budget (which bounds the rescue of the tenant whose
            # part then fails again, alone).
            return Recovery(tenants, [])
        if not bisect:
            return Recovery([], list(batch))
        groups = split(batch, parts)
        if not ride:
            return Recovery(groups, []) if budget.spend(len(groups)) else Recovery([], [], groups)
        # The parts ride in the room fresh batches leave, where one with no poison costs
        # nothing and the one with it sinks one batch: parts of about the square root of
        # the batch, then single inputs, isolate an input in two such rounds, not log2(n).
        size = len(batch)
        return Recovery([], [], split(batch, size if size <= SINGLES_AT else math.isqrt(size)))
    if kind is FailureKind.MALFORMED:
        again = [r for r in batch if not r.malformed_retried]
        for request in again:
            request.malformed_retried = True
        fail = [r for r in batch if r not in again]  # QueuedRequest compares by identity
        if again and not budget.spend(1):
            return Recovery([], fail, spare=[again])
        return Recovery([again] if again else [], fail)
    again = [r for r in batch if not r.moved]
    for request in again:
        request.moved = True
    return Recovery([again] if again else [], [r for r in batch if r not in again])


def by_tenant(batch: list[QueuedRequest]) -> list[list[QueuedRequest]]:
    """`batch`'s requests grouped by tenant, each group in batch order."""
    groups: dict[str, list[QueuedRequest]] = {}
    for request in batch:
        groups.setdefault(request.tenant, []).append(request)
    return list(groups.values())


SINGLES_AT = 16
"""A riding group this small splits into single inputs."""


def split(batch: list[QueuedRequest], parts: int) -> list[list[QueuedRequest]]:
    """`batch` in `parts` contiguous groups (at least 2, at most one per request) whose
    sizes differ by at most one."""
    parts = max(2, min(parts, len(batch)))
    size, extra = divmod(len(batch), parts)
    groups, start = [], 0
    for index in range(parts):
        end = start + size + (index >= parts - extra)
        groups.append(batch[start:end])
        start = end
    return groups


PROBE_INPUT = "batchserve-probe"
"""The one input of the batch that tests whether a device that hung answers again."""
