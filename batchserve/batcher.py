"""The batching loop: a thin coroutine that asks each lane's policy when to send, and sends.

The batcher owns the accepted requests, one lane per compatibility key (model version,
canonical params, length bucket): a batch call never mixes keys. In front of the lanes is
the retry lane (groups from failed batches, run again as they are, before anything new). A
free device goes to the lanes its versions serve: each lane's policy says whether a batch of
it would leave now, and among those that would, the lane that has had the least device time
goes first (start-time fair queuing, ties to the earliest deadline), so a cold key never
waits behind a hot one's backlog. The one task that forms batches wakes only when something
could change the answer: a request arrives while a device is free, a device frees or fails,
or a policy's own wake-up time comes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from .batching.faults import BatchFailure, FailureKind, RetryBudget, plan_recovery
from .batching.poison import PoisonMemory
from .batching.request import QueuedRequest
from .clock import Clock
from .errors import BatchserveError, NotReady, Overloaded
from .gpu_pool import HEALTHY, GpuPool
from .models.registry import Key, ModelVersion
from .rules.capacity import DecayedRate
from .rules.fair_queue import TIER_RANKS, FairQueue, predicted_wait_s
from .rules.policy import FlushReason, QueueView
from .tasks import CrashHandler, TaskSet

log = logging.getLogger(__name__)

ADMISSION_UTILIZATION = 0.9
"""The share of the measured capacity that shedding counts on: headroom for the policy's
holds, partly filled batches and error in the estimate."""


@dataclass(frozen=True, slots=True)
class BatcherStats:
    queued: int
    in_flight: int
    free_devices: int
    healthy_devices: int
    batches: int
    completed: int


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


class Lane:
    """The waiting requests of one compatibility key, and its share of device time so far."""

    __slots__ = ("key", "max_batch", "queue", "tag")

    def __init__(self, key: Key, tag: float) -> None:
        self.key = key
        self.queue = FairQueue[QueuedRequest]()
        self.tag = tag
        """Virtual time at which its next batch starts; smaller goes first."""
        spec = key.version.spec
        self.max_batch = spec.max_batch_size
        if spec.max_batch_tokens is not None:
            longest = (1 << key.bucket) - 1  # the bucket's longest input
            self.max_batch = max(1, min(self.max_batch, spec.max_batch_tokens // longest))

    def __repr__(self) -> str:
        label = self.key.version.spec.label
        return f"<Lane {label} bucket={self.key.bucket} queued={len(self.queue)}>"

    def predicted_s(self, size: int) -> float | None:
        """The batch time of `size` of this lane's requests, padded to the bucket's top."""
        return self.key.version.estimate.predict(size * max(1, (1 << self.key.bucket) - 1))


def length_bucket(version: ModelVersion, tokens: int) -> int:
    """Length-cost versions group inputs whose lengths are within 2x of each other (bucket
    b holds 2^(b-1) to 2^b - 1 tokens); flat ones have one bucket."""
    return tokens.bit_length() if version.spec.cost == "length" else 0


class Batcher:
    """Hears from the engine of finished and failed batches and of health changes."""

    def __init__(
        self,
        pool: GpuPool,
        *,
        clock: Clock,
        max_queue: int,
        bisect_failures: bool,
        retry_budget: RetryBudget,
        shed: bool,
        poison_memory: int,
        on_crash: CrashHandler,
    ):
        self._pool = pool
        self._clock = clock
        self.max_queue = max_queue
        """Queued requests beyond which it refuses more (503); the engine may change it."""
        self._bisect = bisect_failures
        self._retry_budget = retry_budget
        self._lanes: dict[Key, Lane] = {}
        self._queued = 0
        self._virtual_time = 0.0
        self._shed = shed
        self._poison = PoisonMemory(poison_memory)
        self._retries: deque[tuple[Key, list[QueuedRequest]]] = deque()
        """Groups of failed batches the retry budget paid for: they go before anything new."""
        self._rescues: deque[tuple[Key, list[QueuedRequest]]] = deque()
        """Groups it could not pay for, biggest first: they go to devices that would idle."""
        self.recoveries: Counter[str] = Counter()
        """Requests sent round again by kind of failure, and those answered 500."""
        self._wakeup = asyncio.Event()
        self._tasks = TaskSet(on_crash)
        self._watchers: list[tuple[Callable[[BatcherStats], bool], asyncio.Future[None]]] = []
        self._batches = 0
        self._completed = 0
        self._drain_rate = DecayedRate()
        self._arrival_rate = DecayedRate()
        self._first_tries = DecayedRate()
        self._first_tries_failed = DecayedRate()
        """Fresh batches sent and failed lately: rides pay only while few fail."""
        self._rides_sent = DecayedRate()
        self._rides_sunk = DecayedRate()
        """Rides lately, and those whose batch failed: rides pay only while few sink."""
        self._tier_rates = [DecayedRate() for _ in TIER_RANKS]
        """Arrivals a second by tier rank: what higher tiers will claim of the capacity."""
        self.batch_sizes: Counter[int] = Counter()
        """How many batches of each size were sent, retries included."""
        self.batch_fill: Counter[tuple[str, str, str]] = Counter()
        """Per (model, version, kind): batches sent ("batches") and requests in them
        ("requests"). Keyed by names, not the version object, so a removed version is not
        kept; `forget` drops a removed version's counts."""

    def forget(self, model: str, version: str) -> None:
        """Drops the counts of a version that was removed, so that adding and removing
        versions does not grow them (or the metric series read from them)."""
        for kind in ("batches", "requests"):
            self.batch_fill.pop((model, version, kind), None)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<Batcher lanes={len(self._lanes)} queued={s.queued} in_flight={s.in_flight}"
            f" batches={s.batches}>"
        )

    def stats(self) -> BatcherStats:
        return BatcherStats(
            queued=self._queued + self._retrying(),
            in_flight=self._pool.in_flight_requests,
            free_devices=self._pool.free_count,
            healthy_devices=self._pool.healthy,
            batches=self._batches,
            completed=self._completed,
        )

    def queued_for(self, version: ModelVersion) -> int:
        """Requests of `version` waiting, in its lanes or to be retried."""
        waiting = sum(
            len(lane.queue) for key, lane in self._lanes.items() if key.version is version
        )
        return waiting + sum(len(g) for key, g in self._groups() if key.version is version)

    async def __aenter__(self) -> Batcher:
        self._tasks.start(self._run(), name="batchserve-batcher")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._tasks.aclose()

    def submit(self, request: QueuedRequest) -> None:
        if self._queued >= self.max_queue:
            raise Overloaded(
                f"the queue holds its limit of {self.max_queue} requests",
                retry_after_s=self._drain_time_s(),
            )
        poison = self._poison.recall(request.key, request.input, request.arrival)
        if poison:
            request.key = dataclasses.replace(request.key, poison=poison)
            self.recoveries["poison_repeats"] += 1
            log.info("request %s repeats a known poison input: it runs apart", request.request_id)
        lane = self._lanes.get(request.key)
        if lane is None:
            lane = self._lanes[request.key] = Lane(request.key, self._virtual_time)
        if self._shed:
            self._refuse_if_late(request, lane)
            self._tier_rates[request.tier_rank].add(request.arrival, 1)
        lane.queue.push(request)
        self._queued += 1
        self._arrival_rate.add(request.arrival, 1)
        request.key.version.arrivals.add(request.arrival, 1)
        if not self._wakeup.is_set() and self._pool.free_count:
            self._wakeup.set()
        self._changed()

    def discard(self, request: QueuedRequest) -> None:
        """Forgets a request its handler is done with; it may have been answered while queued
        (timeout, disconnect), and then leaves the queue before any batch is formed."""
        lane = None if request.running else self._lanes.get(request.key)  # ran: not queued
        if lane is not None and lane.queue.discard(request):
            self._queued -= 1
            if not lane.queue:
                del self._lanes[lane.key]
        self._changed()

    def fail_queued(self, error: BatchserveError, version: ModelVersion | None = None) -> None:
        """Answers every waiting request (of `version`, if given) with `error`."""
        lanes = [lane for lane in self._lanes.values() if version in (None, lane.key.version)]
        groups = [g for _, g in self._groups(version)]
        for request in itertools.chain(*(lane.queue for lane in lanes), *groups):
            if not request.future.done():
                request.future.set_exception(error)
        for lane in lanes:
            self._queued -= len(lane.queue)
            del self._lanes[lane.key]
        for queue in (self._retries, self._rescues):
            kept = [(key, g) for key, g in queue if version not in (None, key.version)]
            queue.clear()
            queue.extend(kept)
        self._changed()

    def _groups(self, version: ModelVersion | None = None) -> list[tuple[Key, list[QueuedRequest]]]:
        """The groups waiting to run again (of `version`, if given): paid, then spare."""
        return [
            (key, group)
            for key, group in itertools.chain(self._retries, self._rescues)
            if version in (None, key.version)
        ]

    def batch_done(self, finished: float, answered: int) -> None:
        self._completed += answered
        self._drain_rate.add(finished, answered)
        self._wakeup.set()
        self._changed()

    def batch_failed(self, batch: list[QueuedRequest], key: Key, failure: BatchFailure) -> None:
        """Plans the rescue of a failed batch: split over the free devices, paid for by the
        retry budget, or left for spare device time."""
        # The pool has added this device to each request's failed_on already.
        error = failure.answer_for(batch)  # before `batch` may become the call's riders
        first_try = not any(request.rider or len(request.failed_on) > 1 for request in batch)
        if first_try and len(batch) > 1:
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
        recovery = plan_recovery(
            batch,
            failure.kind,
            bisect=self._bisect,
            budget=self._retry_budget,
            parts=self._pool.free_for(key.version),
            # A lone rider has not failed alone: fresh requests beside it may hold poison.
            unproven=bool(fresh)
            or (
                len(set(batch[0].failed_on)) < 2
                and self._pool.healthy_avoiding(key.version, batch[0].failed_on) > 0
            ),
            known_poison=bool(key.poison),
            ride=self._rides_coming(key),
        )
        for request in batch:
            request.rescue_round += 1
            request.running = False
        self._retries.extendleft((key, group) for group in reversed(recovery.retry))
        if fresh:
            for request in fresh:
                request.running = False
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
        if failure.kind is FailureKind.RAISED and recovery.fail and (len(batch) == 1 or key.poison):
            for request in recovery.fail:
                self._found_poison(request)
        self._fail(recovery.fail, error)
        self._wakeup.set()
        self._changed()

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
        self._pool.poison_found(request)
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

    def health_changed(self) -> None:
        """Fails what no healthy device is left to run."""
        if not self._pool.healthy:
            self.fail_queued(NotReady("no healthy device is left to run this request"))
        waiting = itertools.chain(self._lanes, (key for key, _ in self._groups()))
        for version in {key.version for key in waiting}:
            if not self._pool.healthy_for(version):
                self.fail_queued(
                    NotReady(f"no healthy device is left to run {version.spec.label}"), version
                )
        self._wakeup.set()
        self._changed()

    async def wait_until(self, predicate: Callable[[BatcherStats], bool]) -> None:
        """Returns once `predicate(stats())` holds: for draining, and for tests."""
        if predicate(self.stats()):
            return
        future = asyncio.get_running_loop().create_future()
        watcher = (predicate, future)
        self._watchers.append(watcher)
        try:
            await future
        finally:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def _changed(self) -> None:
        if not self._watchers:
            return
        stats = self.stats()
        for watcher in [w for w in self._watchers if w[0](stats)]:
            self._watchers.remove(watcher)
            if not watcher[1].done():
                watcher[1].set_result(None)

    def _refuse_if_late(self, request: QueuedRequest, lane: Lane) -> None:
        """Sheds a request predicted to miss its deadline: the lowest tiers first, since
        every higher tier's queued requests are ahead of theirs, and the higher tiers' new
        arrivals will take their share of the capacity meanwhile."""
        ahead = (
            lane.queue.ahead_of(request.tenant, request.tier_rank, request.tenant_weight)
            + self._retrying()
        )
        version = request.key.version
        capacity, call_s = self.capacity_rps(version), version.estimate.seconds
        if not capacity or not call_s:
            return  # nothing measured yet: no grounds to refuse
        claimed = sum(rate.at(request.arrival) for rate in self._tier_rates[: request.tier_rank])
        left = capacity * ADMISSION_UTILIZATION - claimed
        wait_s = predicted_wait_s(ahead, left, call_s)
        if wait_s > request.deadline - request.arrival:
            raise Overloaded(
                f"predicted to wait {wait_s:.2f} s behind {ahead} requests, past its deadline",
                retry_after_s=ahead / left if left > 0 else self._drain_time_s(),
            )

    def arrival_rps(self, now: float) -> float:
        return self._arrival_rate.at(now)

    def capacity_rps(self, version: ModelVersion | None = None) -> float | None:
        """Requests a second the healthy devices can take in full batches of `version`;
        without one, of the versions they run (each device at its fastest). None until a
        batch has finished, since the call time is measured, not assumed."""
        if version is not None:
            call_s = version.estimate.seconds
            if not call_s:
                return None
            return self._devices_left(version) * version.spec.max_batch_size / call_s
        rates = [
            max(measured)
            for device in self._pool.devices
            if device.state in HEALTHY
            and (measured := [rate for v in device.fns if (rate := _full_batch_rps(v))])
        ]
        return sum(rates) if rates else None

    def _devices_left(self, version: ModelVersion) -> float:
        """The healthy devices `version` can count on: what the versions sharing them took
        of their time lately is not, though start-time fair queuing leaves it at least an
        even split when all want more."""
        devices = self._pool.healthy_for(version)
        sharing = self._pool.sharing(version)
        if len(sharing) < 2:
            return devices
        now = self._clock.time()
        taken = sum(v.device_time.at(now) for v in sharing if v is not version)
        return max(devices - taken, devices / len(sharing))

    def predicted_queue_wait_s(self, queued: int) -> float:
        """How long a request arriving now would wait for the `queued` ahead of it to drain."""
        capacity = self.capacity_rps()
        if not queued:
            return 0.0
        return queued / capacity if capacity else math.inf

    def _retrying(self) -> int:
        """Requests waiting to run again: the paid ones go before the queue."""
        return sum(len(group) for _, group in self._groups())

    def _drain_time_s(self) -> float:
        rate = self._drain_rate.at(self._clock.time())
        return self._queued / rate if rate > 0 else 1.0

    async def _run(self) -> None:
        clock = self._clock
        while True:
            self._wakeup.clear()
            now = clock.time()
            if self._retries and self._send_retry(now):
                continue
            lane, count, wake_at, reason = self._choose(now)
            if lane is not None:
                riders = self._riders(lane, count, now)
                batch = self._take(lane, min(count, lane.max_batch - len(riders)), now)
                self._first_tries.add(now, 1)
                self._send(lane.key, batch + riders, reason)
                # Retries are paid from spare capacity only: none accrues while a backlog
                # of a full batch or more is left waiting.
                if len(lane.queue) < lane.max_batch:
                    self._retry_budget.on_first_try()
                continue
            if self._rescues and self._send_spare(now):
                continue
            alarm = None if wake_at is None else clock.call_at(wake_at, self._wakeup.set)
            await self._wakeup.wait()
            if alarm is not None:
                alarm.cancel()

    def _send_retry(self, now: float) -> bool:
        """Sends the first paid retry that a free device can run; False if none can."""
        for index, (key, group) in enumerate(self._retries):
            if self._can_run(key, group):
                del self._retries[index]
                self._send(key, self._rescue_call(group, now))
                return True
        return False

    def _send_spare(self, now: float) -> bool:
        """Sends the first unpaid rescue group that may take a free device now. No fresh
        batch would leave, so a device takes one only where it would otherwise idle: nothing
        fresh waits, or another device is free for the batch being held (taking the only
        free one would delay it a call). A flat-cost model's group takes its key's waiting
        requests along, as many as fit, and may then take the last free device: the call
        costs the same, and it answers now those the held batch would have."""
        held = bool(self._lanes) and self._pool.free_count <= 1
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
                batch = self._take(lane, room, now) + self._ride(batch)
            self._send(key, batch)
            return True
        return False

    def _rescue_call(self, group: list[QueuedRequest], now: float) -> list[QueuedRequest]:
        """What of a rescue group still waits, counted as a rescue call if anything does."""
        batch = _still_waiting(group, now)
        self.recoveries["rescue_calls"] += bool(batch)
        return batch

    def _can_run(self, key: Key, group: list[QueuedRequest]) -> bool:
        """Whether a device that may run `group` is free."""
        failed_on = group[0].failed_on
        if group[0].device_retried and self._pool.healthy_avoiding(key.version, failed_on):
            # A lone input, proving it fails on a device it has not failed on yet.
            return bool(self._pool.free_avoiding(key.version, failed_on))
        if self._pool.healthy_avoiding(key.version, last := failed_on[-1:]):
            # Not back to the device it just failed on: a broken device, failing fast, is
            # free most often, and would take its whole rescue with nobody answered.
            return bool(self._pool.free_avoiding(key.version, last))
        return bool(self._pool.free_for(key.version))

    def _riders(self, lane: Lane, size: int, now: float) -> list[QueuedRequest]:
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
                return self._ride(_still_waiting(group, now))
        return []

    def _ride(self, group: list[QueuedRequest]) -> list[QueuedRequest]:
        """Marks a rescue group sent beside fresh requests: if the call fails, it is blamed."""
        for request in group:
            request.rider = True
        self.recoveries["rides"] += bool(group)
        if group:
            self._rides_sent.add(self._clock.time(), 1)
        return group

    def _send(self, key: Key, batch: list[QueuedRequest], reason: FlushReason = "rescue") -> None:
        """Starts `batch` on a device; `reason`, why it leaves, is for its trace span (the
        rescue calls pass none)."""
        if batch:
            self._batches += 1
            self.batch_sizes[len(batch)] += 1
            model, version = key.version.name, key.version.version
            self.batch_fill[model, version, "batches"] += 1
            self.batch_fill[model, version, "requests"] += len(batch)
            self._pool.dispatch(batch, self._batches, key, reason)
        self._changed()

    def _choose(self, now: float) -> tuple[Lane | None, int, float | None, FlushReason]:
        """The lane to send from now, how many of its requests and why; else when to look
        again.

        Among the lanes whose policy would send now, the one with the smallest virtual start
        tag: each batch advances its lane's tag by its predicted time over the weight of the
        tenants waiting in it, so lanes share the devices' time in proportion to the tenants
        they serve whatever their traffic (a tenant flooding a length bucket of its own gets
        a tenant's share, not the bucket's), and a lane that wakes from idle starts at the
        current virtual time rather than with credit saved up."""
        best: tuple[float, float, Lane, int, FlushReason] | None = None
        wake_at: float | None = None
        reason: FlushReason
        for lane in self._lanes.values():
            free = self._pool.free_for(lane.key.version)
            if not free:
                continue  # a device freeing wakes the loop
            size = len(lane.queue)
            if size >= lane.max_batch:
                count, reason = lane.max_batch, "full"
            else:
                head = lane.queue.head(size)
                view = QueueView(
                    size=size,
                    oldest_arrival=head[0].arrival,
                    earliest_deadline=min(request.deadline for request in head),
                    service_s=lane.predicted_s(size),
                    device_share=self._device_share(lane.key.version, now),
                )
                decision = lane.key.version.policy.decide(
                    now, view, free, self._pool.busy_since_of(lane.key)
                )
                count, reason = min(decision.dispatch, lane.max_batch), decision.reason
                if not count:
                    if decision.wake_at is not None:
                        wake_at = (
                            decision.wake_at if wake_at is None else min(wake_at, decision.wake_at)
                        )
                    continue
            if best is None and len(self._lanes) == 1:
                return lane, count, None, reason
            rank = (max(lane.tag, self._virtual_time), lane.queue.head(1)[0].deadline)
            if best is None or rank < best[:2]:
                best = (*rank, lane, count, reason)
        if best is None:
            return None, 0, wake_at, "policy"
        start, _, lane, count, reason = best
        self._virtual_time = start
        lane.tag = start + (lane.predicted_s(count) or 1.0) / lane.queue.weight
        return lane, count, None, reason

    def _device_share(self, version: ModelVersion, now: float) -> float | None:
        """The devices `version`'s partial batches may spread over where other versions
        share them: its part of their arrivals. (Counting what the others leave idle as
        well was measured worse: the small batches it allows take time the others then
        lack, so their share falls and this one's grows.) None where it has its devices
        to itself."""
        sharing = self._pool.sharing(version)
        if len(sharing) < 2:
            return None
        total = sum(v.arrivals.at(now) for v in sharing)
        if total <= 0:
            return None
        return self._pool.healthy_for(version) * version.arrivals.at(now) / total

    def _take(self, lane: Lane, count: int, now: float) -> list[QueuedRequest]:
        """`count` requests in batch order; expired ones are answered 504 instead."""
        taken = lane.queue.take(count)
        self._queued -= len(taken)
        if not lane.queue:
            del self._lanes[lane.key]
        return _still_waiting(taken, now)


def _full_batch_rps(version: ModelVersion) -> float | None:
    call_s = version.estimate.seconds
    return version.spec.max_batch_size / call_s if call_s else None


def _ride_reserve(max_batch: int) -> int:
    """The room a full fresh batch keeps for riders: twice the biggest part a split of a
    full batch makes (about its square root), so that any part fits."""
    return 2 * math.ceil(math.sqrt(max_batch))


def _still_waiting(requests: list[QueuedRequest], now: float) -> list[QueuedRequest]:
    """Those of `requests` not yet answered; one whose deadline passed is answered 504.
    A loop, not a call per request: it runs over every request of every batch."""
    waiting = []
    for request in requests:
        if request.deadline <= now:
            request.expire()
        elif not request.future.done():
            waiting.append(request)
    return waiting
