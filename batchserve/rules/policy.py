"""When a batch leaves and how big it is: pure decisions on plain numbers (sans-IO).

The batcher asks a policy, with `now` and the queue's state passed in, what to do; the batch
time comes from the engine's one estimate (`capacity.CallTime`). Nothing here reads a clock
or awaits, so the same objects drive the live server, the virtual-time simulator in
benchmarks/ and property tests.

Both policies bind late: a batch is formed only when a device is free to take it, so a
batch keeps growing while every device is busy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..config import PolicyName
from .capacity import CallTime


@dataclass(frozen=True, slots=True)
class QueueView:
    """What the policy may know of the queue: its size and its most urgent times."""

    size: int
    oldest_arrival: float = math.inf
    earliest_deadline: float = math.inf
    service_s: float | None = None
    """The predicted time of a batch of these requests, where it depends on their lengths;
    None: the version's typical batch time."""
    device_share: float | None = None
    """The devices this queue's traffic is entitled to where other versions share them (in
    proportion to its arrivals); None: all of them."""


FlushReason = Literal["full", "idle", "spacing", "linger", "deadline", "policy", "rescue"]
"""Why a batch left (a batch span's `batchserve.flush_reason`): full; idle (no device busy,
or no batch time measured yet: nothing to wait for); spacing (S / D since the last start has
passed); linger (the oldest request's linger budget ran out); deadline (holding longer would
leave less than a batch time before a queued deadline); policy (a policy that names no
reason); rescue (a failed batch's requests, run again: the batcher's, not a policy's)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Send the `dispatch` oldest requests now (0: none), else decide again at `wake_at`.

    `wake_at` None means nothing changes until a request arrives or a device frees.
    """

    dispatch: int
    wake_at: float | None = None
    reason: FlushReason = field(default="policy", compare=False)
    """Why the batch leaves now, for its trace span; not part of the decision's value."""


WAIT = Decision(0)

SPACING_SHARE = 0.9
"""Starts are spaced a little under S / D: each is late by however long the event loop takes
to get to it, and measured from the last actual start that lateness would add up, leaving
devices idle under load (simulated with 0-6 ms late starts at D=4 / 3,000 rps: mean batch 84
at the full S / D, 80 at 0.9 of it, 79 for the rule that spaces nothing)."""

MIN_HOLD_S = 0.0005
"""A shorter hold saves less than the wake-up costs (and could round to no time at all)."""


class Policy(Protocol):
    def decide(
        self, now: float, queue: QueueView, free_devices: int, busy_since: Sequence[float]
    ) -> Decision: ...


class AdaptivePolicy:
    """Keeps devices' start times evenly spaced, so a new request never waits long for one.

    With D devices and batch time S, a device frees every S / D when starts are evenly
    spaced, so no request waits longer than S / D for its batch to start. Sending a partial
    batch sooner than S / D after the last start bunches the devices: they then free
    together, and a request that arrives just after they all started waits nearly a whole
    batch time. So a partial batch leaves no sooner than S / D after the most recent start;
    a full batch leaves at once. After a quiet spell the last start is long past and a
    request leaves as soon as it arrives; a lone device (S / 1 after its start it is free
    again) never holds. Holds never pass the oldest request's linger budget or leave less
    than one batch time before a queued request's deadline.

    Where versions share devices, a queue spaces its partial batches over its share of them
    only: a version with 5 % of the traffic on 4 devices sending a 3-request batch every
    S / 4 would take all four from a busy neighbour whose full batches need them.
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_linger_s: float | None,
        call_time: CallTime,
        slo_s: float | None = None,
    ) -> None:
        """`max_linger_s` None derives the linger budget from `slo_s`: what the objective
        leaves after the predicted batch time."""
        self.max_batch_size = max_batch_size
        self.max_linger_s = max_linger_s
        self.slo_s = slo_s
        self._call_time = call_time

    def decide(
        self, now: float, queue: QueueView, free_devices: int, busy_since: Sequence[float]
    ) -> Decision:
        if queue.size == 0 or free_devices == 0:
            return WAIT
        if queue.size >= self.max_batch_size:
            return Decision(self.max_batch_size, reason="full")
        service = self._call_time.seconds if queue.service_s is None else queue.service_s
        if service is None or not busy_since:
            return Decision(queue.size, reason="idle")
        devices = float(free_devices + len(busy_since))
        if queue.device_share is not None:
            devices = min(devices, max(1.0, queue.device_share))
        spacing = SPACING_SHARE * service / devices
        linger_s = self.max_linger_s
        if linger_s is None:
            linger_s = max(0.0, (self.slo_s or 0.0) - service)
        spaced = max(busy_since) + spacing
        lingered = queue.oldest_arrival + linger_s
        latest = min(spaced, lingered, queue.earliest_deadline - service)
        if latest - now < MIN_HOLD_S:
            why: FlushReason = "spacing" if latest == spaced else "linger"
            if latest not in (spaced, lingered):
                why = "deadline"
            return Decision(queue.size, reason=why)
        return Decision(0, latest)


class FixedPolicy:
    """The textbook rule, for comparison: send at `max_batch_size` or after the linger time."""

    def __init__(self, *, max_batch_size: int, max_linger_s: float) -> None:
        self.max_batch_size = max_batch_size
        self.max_linger_s = max_linger_s

    def decide(
        self, now: float, queue: QueueView, free_devices: int, busy_since: Sequence[float]
    ) -> Decision:
        if queue.size == 0:
            return WAIT
        due = queue.oldest_arrival + self.max_linger_s
        if queue.size < self.max_batch_size and now < due:
            return Decision(0, due)
        if free_devices == 0:
            return WAIT
        full = queue.size >= self.max_batch_size
        return Decision(min(queue.size, self.max_batch_size), reason="full" if full else "linger")


class BatchLimits(Protocol):
    """What `make_policy` reads of a model version's spec (models.specs.ModelSpec): named
    here so that the rules import nothing from the models above them."""

    @property
    def max_batch_size(self) -> int: ...
    @property
    def slo_ms(self) -> float | None: ...
    @property
    def max_linger_ms(self) -> float | None: ...


def make_policy(
    kind: PolicyName, spec: BatchLimits, default_linger_ms: float, call_time: CallTime
) -> Policy:
    """The policy --policy names, for one model version; the adaptive one reads that
    version's batch-time estimate. Its linger budget is the version's `max_linger_ms`, else
    derived from its `slo_ms`, else the server's --max-linger-ms."""
    linger_ms = spec.max_linger_ms
    if linger_ms is None and spec.slo_ms is None:
        linger_ms = default_linger_ms
    if kind == "fixed":
        fixed_ms = linger_ms if linger_ms is not None else default_linger_ms
        return FixedPolicy(max_batch_size=spec.max_batch_size, max_linger_s=fixed_ms / 1e3)
    return AdaptivePolicy(
        max_batch_size=spec.max_batch_size,
        max_linger_s=None if linger_ms is None else linger_ms / 1e3,
        call_time=call_time,
        slo_s=None if spec.slo_ms is None else spec.slo_ms / 1e3,
    )
