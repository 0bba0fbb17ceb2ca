"""The rescue of failed batches: what runs again, when, and beside what.

A failed batch's requests go round again in groups (`faults.plan_recovery`: split, retry
once, or fail). Groups the retry budget pays for run before anything new (`take_retry`);
the rest wait for spare device time (`take_spare`), or ride in the room a flat-cost model's
fresh batch leaves (`riders`), while rides pay: few fresh batches fail on their own and few
rides sink theirs. A request that fails alone is poison: it is answered 500 and remembered,
and a repeat of it runs apart. The batcher owns one `Rescue` and calls it; this module owns
the groups, the budget, the poison memory and the counts (`recoveries`), and asks the
devices only through the narrow `Devices` view.

A failed call of Batch API lines (IDLE_RANK) is planned by the same rules, but its groups go
back to the idle lines (`to_idle`), paid by nobody's budget: idle time is theirs to spend,
and a line must never run ahead of online work nor ride in its batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from ..clock import Clock
from ..errors import BatchserveError
from ..models.registry import Key, ModelVersion
from ..rules.capacity import DecayedRate
from ..rules.fair_queue import FairQueue
from ..rules.tenants import IDLE_RANK
from .faults import BatchFailure, FailureKind, RetryBudget, plan_recovery
from .poison import PoisonMemory
from .request import QueuedRequest

log = logging.getLogger(__name__)

RIDE_MAX_FAILING = 0.25
"""Rescue rides in fresh batches while at most this share of first tries fails (0.1 %
poison in batches of 90 fails 9 %, 1 % fails 60 %): under a flood of poison a ride would
sink more fresh requests than it answers."""
RIDE_MAX_SUNK = 0.5
"""Rescue rides only while at most this share of rides sinks its batch too: a ride saves
its group a call, a sunk one costs its fresh requests a call again (measured: 18-21 % sink
at 0.1 % poison, 53-55 % at 1 %, since a group carries the poison that failed its batch)."""
RIDE_PROBE_RATE = 0.25
"""Sunk rides a second (decayed) under which rides are tried again after they stopped."""

Group = tuple[Key, list[QueuedRequest]]
IDLE_BUDGET = RetryBudget(ratio=0.0, reserve=math.inf, tokens=math.inf)
"""What pays for a failed idle call's groups: unbounded, since they run only in idle time;
its rounds are bounded by the rules themselves (halving, once for a hang)."""


class Devices(Protocol):
    """What rescue asks of the devices (the pool)."""

    @property
    def free_count(self) -> int: ...

    def free_for(self, version: ModelVersion, avoid: tuple[str, ...] = ()) -> int: ...

    def healthy_for(self, version: ModelVersion, avoid: tuple[str, ...] = ()) -> int: ...

    def poison_found(self, request: QueuedRequest) -> None: ...


class LaneView(Protocol):
    """What rescue reads of a lane: its key's waiting requests and their batch limit."""

    @property
    def key(self) -> Key: ...

    @property
    def max_batch(self) -> int: ...

    @property
    def queue(self) -> FairQueue[QueuedRequest]: ...


class Rescue:
    """The groups of failed batches waiting to run again, and the rules that send them."""

    def __init__(
        self,
        devices: Devices,
        lanes: Mapping[Key, LaneView],
        *,
        clock: Clock,
        bisect_failures: bool,
        retry_budget: RetryBudget,
        poison_memory: int,
        to_idle: Callable[[Key, list[QueuedRequest]], None],
    ) -> None:
        self._devices = devices
        self._to_idle = to_idle
        self._lanes = lanes
        """The batcher's lanes, read only: whether fresh requests of a key wait."""
        self._clock = clock
        self._bisect = bisect_failures
        self._retry_budget = retry_budget
        self._poison = PoisonMemory(poison_memory)
        self._retries: deque[Group] = deque()
        """Groups of failed batches the retry budget paid for: they go before anything new."""
        self._rescues: deque[Group] = deque()
        """Groups it could not pay for, biggest first: they go to devices that would idle."""
        self.recoveries: Counter[str] = Counter()
        """Requests sent round again by kind of failure, and those answered 500."""
        self._first_tries = DecayedRate()
        self._first_tries_failed = DecayedRate()
        """Fresh batches sent and failed lately: rides pay only while few fail."""
        self._rides_sent = DecayedRate()
        self._rides_sunk = DecayedRate()
        """Rides lately, and those whose batch failed: rides pay only while few sink."""

    def __repr__(self) -> str:
        return f"<Rescue paid={len(self._retries)} spare={len(self._rescues)}>"

    @property
    def paid_waiting(self) -> bool:
        """Whether a group the budget paid for waits: it goes before anything new."""
        return bool(self._retries)

    @property
    def spare_waiting(self) -> bool:
        return bool(self._rescues)

    @property
    def any_waiting(self) -> bool:
        """Whether any group waits to run again: asked at every change of the batcher."""
        return bool(self._retries or self._rescues)

    def recall(self, request: QueuedRequest) -> None:
        """A new request that repeats a known poison input gets a key of its own."""
        poison = self._poison.recall(request.key, request.input, request.arrival)
        if poison:
            request.key = dataclasses.replace(request.key, poison=poison)
            self.recoveries["poison_repeats"] += 1
            log.info("request %s repeats a known poison input: it runs apart", request.request_id)

    def groups(self, version: ModelVersion | None = None) -> list[Group]:
        """The groups waiting to run again (of `version`, if given): paid, then spare."""
        return [
            (key, group)
            for key, group in itertools.chain(self._retries, self._rescues)
            if version in (None, key.version)
        ]

    def retrying(self) -> int:
        """Requests waiting to run again: the paid ones go before the queue."""
        return sum(len(group) for _, group in self.groups())

    def waiting(self, version: ModelVersion | None = None) -> Iterator[QueuedRequest]:
        """Every request waiting to run again (of `version`, if given)."""
        return itertools.chain.from_iterable(group for _, group in self.groups(version))

    def drop(self, version: ModelVersion | None = None) -> None:
        """Forgets the groups (of `version`, if given); the caller has answered them."""
        for queue in (self._retries, self._rescues):
            kept = [(key, g) for key, g in queue if version not in (None, key.version)]
            queue.clear()
            queue.extend(kept)

    def first_try_sent(self, now: float, *, backlog: bool) -> None:
        """A fresh batch left. Retries are paid from spare capacity only: none accrues
        while a `backlog` of a full batch or more is left waiting."""
        self._first_tries.add(now, 1)
        if not backlog:
            self._retry_budget.on_first_try()

    def batch_failed(self, batch: list[QueuedRequest], key: Key, failure: BatchFailure) -> None:
        """Plans the rescue of a failed batch: split over the free devices, paid for by the
        retry budget, or left for spare device time."""
        # The pool has added this device to each request's failed_on already.
        error = failure.answer_for(batch)  # before `batch` may become the call's riders
        idle = batch[0].tier_rank == IDLE_RANK  # a call never mixes idle and online
        first_try = not any(request.rider or len(request.failed_on) > 1 for request in batch)
        if first_try and len(batch) > 1 and not idle:
            self.recoveries["first_try_batches_failed"] += 1
            self._first_tries_failed.add(self._clock.time(), 1)
        fresh: list[QueuedRequest] = []
        if failure.kind is FailureKind.RAISED and (riders := [r for r in batch if r.rider]):
            fresh = [request for request in batch if not request.rider]
            for request in riders:
                request.rider = False
            if fresh:
                # Its rescue group, which held the batch's poison input when one of its
                # failed calls did, most likely sank it: the fresh requests run again first,
                # whole and unpaid, and only the riders are split further.
                self.recoveries["rides_failed"] += 1
                self._rides_sunk.add(self._clock.time(), 1)
                batch = riders
        devices = self._devices
        recovery = plan_recovery(
            batch,
            failure.kind,
            bisect=self._bisect,
            budget=IDLE_BUDGET if idle else self._retry_budget,
            parts=devices.free_for(key.version),
            # A lone rider has not failed alone: fresh requests beside it may hold poison.
            unproven=bool(fresh)
            or (
                len(set(batch[0].failed_on)) < 2
                and devices.healthy_for(key.version, batch[0].failed_on) > 0
            ),
            known_poison=bool(key.poison),
            ride=not idle and self._rides_coming(key),
        )
        for request in batch:
            request.rescue_round += 1
        if idle:
            again = recovery.retry + recovery.spare
            for group in again:
                self._to_idle(key, group)
            self.recoveries[f"retried_{failure.kind.value}"] += sum(map(len, again))
            self._fail_found(batch, key, failure, recovery.fail, error)
            return
        self._retries.extendleft((key, group) for group in reversed(recovery.retry))
        if fresh:
            self._retries.appendleft((key, fresh))
        # What the budget cannot pay for waits for spare device time, however long the
        # wait: never answered 500 for want of it (at worst 504 at its deadline), since
        # those answered would be innocent requests too, most of them.
        for group in recovery.spare:
            self._rescues.append((key, group))
        waiting = sum(map(len, recovery.spare))
        self.recoveries["waiting_for_spare_time"] += waiting
        if recovery.spare:
            # Spare calls go to the biggest groups first: a call answers its whole group
            # when it holds no poison, and big groups carry most of the innocent requests.
            ranked = sorted(self._rescues, key=lambda waiting: -len(waiting[1]))
            self._rescues = deque(ranked)
        self.recoveries[f"retried_{failure.kind.value}"] += sum(map(len, recovery.retry)) + waiting
        self._fail_found(batch, key, failure, recovery.fail, error)

    def _fail_found(
        self,
        batch: list[QueuedRequest],
        key: Key,
        failure: BatchFailure,
        fail: list[QueuedRequest],
        error: BatchserveError,
    ) -> None:
        """Answers those of `batch` its rescue gave up on; a lone one that raised is poison."""
        if failure.kind is FailureKind.RAISED and fail and (len(batch) == 1 or key.poison):
            for request in fail:
                self._found_poison(request)
        self._fail(fail, error)

    def take_retry(self, now: float) -> Group | None:
        """The first paid retry that a free device can run, and what of it still waits."""
        for index, (key, group) in enumerate(self._retries):
            if self._can_run(key, group):
                del self._retries[index]
                return key, self._rescue_call(group, now)
        return None

    def take_spare(
        self, now: float, take: Callable[[LaneView, int], list[QueuedRequest]]
    ) -> Group | None:
        """The first unpaid rescue group that may take a free device now. No fresh batch
        would leave, so a device takes one only where it would otherwise idle: nothing fresh
        waits, or another device is free for the batch being held (taking the only free one
        would delay it a call). A flat-cost model's group takes its key's waiting requests
        along (`take(lane, count)`), as many as fit, and may then take the last free device:
        the call costs the same, and it answers now those the held batch would have."""
        held = bool(self._lanes) and self._devices.free_count <= 1
        for index, (key, group) in enumerate(self._rescues):
            lane = self._lanes.get(key)
            takes_fresh = (
                lane is not None
                and self._rides_pay(key, now)
                and len(group) < lane.max_batch
                and not group[0].device_retried
                and lane.queue.only(group[0].tenant)
            )
            if (held and not takes_fresh) or not self._can_run(key, group):
                continue
            del self._rescues[index]
            batch = self._rescue_call(group, now)
            if lane is not None and takes_fresh and batch:
                room = min(len(lane.queue), lane.max_batch - len(batch))
                batch = take(lane, room) + self._ride(batch)
            return key, batch
        return None

    def riders(self, lane: LaneView, size: int, now: float) -> list[QueuedRequest]:
        """A rescue group to ride in the room a fresh batch of `size` leaves: for a flat-cost
        model a call costs the same however full, so a group with no poison in it is
        answered for nothing, and one with poison sinks this batch, whose fresh requests
        then run again at once. One group a batch, or the parts of a split would ride
        together again and fail together; lone inputs proving themselves on another device
        run alone. A full batch keeps room for one part of a split: under a backlog of
        fresh requests (the calls that failed made it) there would be none, and the groups,
        older than any fresh request, would wait until the load ends. Not where only the
        device a group just failed on is free: a broken device, failing fast, is the free one
        most often, and would sink ride after ride."""
        room = max(lane.max_batch - size, _ride_reserve(lane.max_batch))
        if not self._rescues or not size or room <= 0 or not self._rides_pay(lane.key, now):
            return []
        for index, (key, group) in enumerate(self._rescues):
            if (
                key == lane.key
                and len(group) <= room
                and not group[0].device_retried
                and lane.queue.only(group[0].tenant)  # never sinks another tenant's batch
                and self._can_run(key, group)
            ):
                del self._rescues[index]
                return self._ride(still_waiting(group, now))
        return []

    def _rides_coming(self, key: Key) -> bool:
        """Whether rides pay for `key` and its fresh requests come often enough (one a call
        or more) for a failed batch's parts to ride with them rather than take calls alone."""
        now = self._clock.time()
        if not self._rides_pay(key, now):
            return False
        if key in self._lanes:
            return True
        call_s = key.version.estimate.seconds or 0.0
        return key.version.arrivals.at(now) * call_s >= 1.0

    def _rides_pay(self, key: Key, now: float) -> bool:
        """Whether rescue groups of `key` may ride in fresh batches: a flat-cost model's
        call costs the same however full, while few fresh batches fail on their own and
        few rides sink theirs."""
        if key.version.spec.cost != "flat":
            return False
        few_fail = self._first_tries_failed.at(now) <= RIDE_MAX_FAILING * self._first_tries.at(now)
        sunk = self._rides_sunk.at(now)
        few_sink = sunk <= RIDE_MAX_SUNK * self._rides_sent.at(now) or sunk < RIDE_PROBE_RATE
        return few_fail and few_sink

    def _fail(self, requests: list[QueuedRequest], error: BatchserveError) -> None:
        for request in requests:
            if not request.future.done():
                request.future.set_exception(error)
                self.recoveries["failed"] += 1

    def _found_poison(self, request: QueuedRequest) -> None:
        """Clears the devices its failures counted against, and remembers it (again: a
        repeat renews its time to live)."""
        self._devices.poison_found(request)
        self._poison.remember(request.key, request.input, self._clock.time())
        if request.key.poison:
            return
        self.recoveries["poison_isolated"] += 1
        self.recoveries["isolation_rounds"] += request.rescue_round
        log.warning(
            "request %s of %s is a poison input; a repeat of it will run apart (%d remembered)",
            request.request_id,
            request.key.version.spec.label,
            len(self._poison),
        )

    def _rescue_call(self, group: list[QueuedRequest], now: float) -> list[QueuedRequest]:
        """What of a rescue group still waits, counted as a rescue call if anything does."""
        batch = still_waiting(group, now)
        self.recoveries["rescue_calls"] += bool(batch)
        return batch

    def _can_run(self, key: Key, group: list[QueuedRequest]) -> bool:
        """Whether a device that may run `group` is free."""
        devices, failed_on = self._devices, group[0].failed_on
        if group[0].device_retried and devices.healthy_for(key.version, failed_on):
            # A lone input, proving it fails on a device it has not failed on yet.
            return bool(devices.free_for(key.version, failed_on))
        if devices.healthy_for(key.version, last := failed_on[-1:]):
            # Not back to the device it just failed on: a broken device, failing fast, is
            # free most often, and would take its whole rescue with nobody answered.
            return bool(devices.free_for(key.version, last))
        return bool(devices.free_for(key.version))

    def _ride(self, group: list[QueuedRequest]) -> list[QueuedRequest]:
        """Marks a rescue group sent beside fresh requests: if the call fails, it is blamed."""
        for request in group:
            request.rider = True
        self.recoveries["rides"] += bool(group)
        if group:
            self._rides_sent.add(self._clock.time(), 1)
        return group


def _ride_reserve(max_batch: int) -> int:
    """The room a full fresh batch keeps for riders: twice the biggest part a split of a
    full batch makes (about its square root), so that any part fits."""
    return 2 * math.ceil(math.sqrt(max_batch))


def still_waiting(requests: list[QueuedRequest], now: float) -> list[QueuedRequest]:
    """Those of `requests` not yet answered; one whose deadline passed is answered 504.
    A loop, not a call per request: it runs over every request of every batch."""
    waiting = []
    for request in requests:
        if request.deadline <= now:
            request.expire()
        elif not request.future.done():
            waiting.append(request)
    return waiting
