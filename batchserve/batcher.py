"""The batching loop: a thin coroutine that asks each lane's policy when to send, and sends.

The batcher owns the accepted requests, one lane per compatibility key (model version,
canonical params, length bucket): a batch call never mixes keys. In front of the lanes is
the retry lane (groups from failed batches, run again as they are, before anything new). A
free device goes to the lanes its versions serve: each lane's policy says whether a batch of
it would leave now, and among those that would, the lane that has had the least device time
goes first (start-time fair queuing, ties to the earliest deadline), so a cold key never
waits behind a hot one's backlog. The one task that forms batches wakes only when something
could change the answer: a request arrives while a device is free, a device frees or fails,
or a policy's own wake-up time comes. Below every lane wait the Batch API's lines
(`batching/idle.py`): a device gets them only when no online lane would send now and no
online request waits for its versions.

The batcher builds its pool and hands it its callbacks (the pool calls them when a batch
ends or a device's health changes). What runs again after a failed batch is
`batching/rescue.py`'s, and the refusal of requests predicted to be late is
`batching/shedding.py`'s: the batcher owns one of each.

Batcher has 24 methods: its public face (submit, discard, fail_queued, the pool's three
callbacks, stats and capacity queries for the engine and metrics) plus the loop's. The module
is about 450 lines for that class and its lanes; what the devices can take
(`batching/throughput.py`) and the waiters on its state (`batching/watchers.py`) are
batching/'s, beside rescue and shedding.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable

from .batching.faults import BatchFailure, RetryBudget
from .batching.idle import IdleLines
from .batching.lanes import Lane
from .batching.online_wait import OnlineWait
from .batching.request import QueuedRequest
from .batching.rescue import LaneView, Rescue, still_waiting
from .batching.shedding import Shedding, refuse_too_short
from .batching.snapshot import BatcherSnapshot, BatcherStats
from .batching.throughput import Throughput, queue_wait_s
from .batching.watchers import Watchers
from .clock import Clock
from .config import Config
from .devices.calls import BatchCall
from .devices.fleet import Devices
from .errors import BatchserveError, NotReady, Overloaded
from .gpu_pool import BatchDone, GpuPool
from .models.registry import Key, ModelVersion
from .rules.capacity import DecayedRate
from .rules.policy import FlushReason, QueueView
from .rules.tenants import IDLE_RANK
from .tasks import CrashHandler, TaskSet


class Batcher:
    """The lanes and the loop, and the pool they dispatch to, which tells them of finished
    and failed batches and of health changes."""

    def __init__(
        self,
        versions: list[ModelVersion],
        config: Config,
        *,
        devices: Devices,
        clock: Clock,
        on_crash: CrashHandler,
        on_call: Callable[[BatchCall], None] | None = None,
        on_batch_ran: BatchDone | None = None,
    ):
        """Builds the pool of `versions` over `devices`, handing it the batcher's callbacks
        (and `on_call`: tracing); `on_batch_ran` hears of each batch call that succeeded
        (the metrics' queue waits and call times)."""
        self.idle = IdleLines(config.idle_call_ms / 1000)
        """The Batch API's lines: outside the queue bound, sent only to idle devices."""
        self.pool = pool = GpuPool(
            versions, clock=clock, on_crash=on_crash, on_call=on_call, devices=devices,
            batch_done=self.batch_done, batch_failed=self.batch_failed,
            health_changed=self.health_changed, idle_started=self._idle_started,
            idle_withdrawn=self.idle.back,
        )  # fmt: skip
        """Its pool, which it starts and closes, the one it dispatches to and hears."""
        self._clock = clock
        self.max_queue = config.max_queue
        """Queued requests beyond which it refuses more (503); the engine may change it."""
        self._lanes: dict[Key, Lane] = {}
        self._queued = 0
        self._virtual_time = 0.0
        self._shared_ratio = config.shared_batch_ratio
        self._shedding = Shedding() if config.keys_file is not None else None
        reserve = config.retry_reserve
        budget = RetryBudget(ratio=config.retry_budget, reserve=reserve, tokens=reserve)
        self._rescue = Rescue(
            pool,
            self._lanes,
            clock=clock,
            bisect_failures=config.bisect_failures,
            retry_budget=budget,
            poison_memory=config.poison_memory,
            to_idle=self.idle.again,
        )
        self.recoveries: Counter[str] = self._rescue.recoveries
        """Requests sent round again by kind of failure, and those answered 500."""
        self._wakeup = asyncio.Event()
        self._tasks = TaskSet(on_crash)
        self._watchers = Watchers(self.stats)
        self._online_wait = OnlineWait()
        self._count_online_wait = config.count_online_wait
        self._batches = 0
        self._completed = 0
        self._throughput = Throughput(pool, clock)
        self._drain_rate = DecayedRate()
        self._arrival_rate = DecayedRate()
        self._on_batch_ran = on_batch_ran
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
            queued=self._queued + self._rescue.retrying(),
            in_flight=self.pool.in_flight_requests,
            free_devices=self.pool.free_count,
            healthy_devices=self.pool.healthy,
            batches=self._batches,
            completed=self._completed,
        )

    def snapshot(self, now: float) -> BatcherSnapshot:
        """The metrics' view; `stats()` stays the cheap one that every state change may read."""
        stats = self.stats()
        queued: Counter[tuple[str, str]] = Counter()
        for key, lane in self._lanes.items():
            queued[key.version.name, key.version.version] += len(lane.queue)
        for key, group in self._rescue.groups():
            queued[key.version.name, key.version.version] += len(group)
        capacity = self.capacity_rps()  # read once: it walks every device's versions
        return BatcherSnapshot(
            queued=stats.queued,
            in_flight=stats.in_flight,
            healthy_devices=stats.healthy_devices,
            capacity_rps=capacity,
            arrival_rps=self.arrival_rps(now),
            predicted_wait_s=queue_wait_s(stats.queued, capacity),
            queued_by_version=dict(queued),
            batch_sizes=dict(self.batch_sizes),
            batch_fill=dict(self.batch_fill),
            recoveries=dict(self.recoveries),
            idle=self.idle.counts(self._online_wait.seconds_at(now)),
        )

    def queued_for(self, version: ModelVersion) -> int:
        """Requests of `version` waiting, in its lanes or to be retried."""
        waiting = sum(
            len(lane.queue) for key, lane in self._lanes.items() if key.version is version
        )
        return waiting + sum(len(g) for _, g in self._rescue.groups(version))

    async def __aenter__(self) -> Batcher:
        """Loads the pool's devices, then starts the loop."""
        await self.pool.__aenter__()
        self._tasks.start(self._run(), name="batchserve-batcher")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Stops the loop, then the pool (what is left of its calls)."""
        await self._tasks.aclose()
        await self.pool.__aexit__()

    def submit(self, request: QueuedRequest) -> None:
        if request.tier_rank == IDLE_RANK:
            refuse_too_short(request)
            self.idle.push(request)
            if not self._wakeup.is_set() and self.pool.free_count:
                self._wakeup.set()
            self._changed()
            return
        if self._queued >= self.max_queue:
            raise Overloaded(
                f"the queue holds its limit of {self.max_queue} requests",
                retry_after_s=self._drain_time_s(),
            )
        self._rescue.recall(request)
        lane = self._lanes.get(request.key)
        if lane is None:
            lane = Lane(request.key, self._virtual_time)
        if self._shedding is not None:
            ahead = lane.queue.ahead_of(request.tenant, request.tier_rank, request.tenant_weight)
            self._shedding.refuse_if_late(
                request,
                ahead + self._rescue.retrying(),
                self.capacity_rps(request.key.version),
                self._drain_time_s,
            )
        # Kept only once it holds a request: `_choose` reads a lane's oldest request, and a
        # lane left empty by a refusal once crashed the batcher there.
        self._lanes[request.key] = lane
        lane.queue.push(request)
        self._queued += 1
        if self.pool.prepared:  # online work goes before any idle call not yet started
            self.pool.prepared.withdraw(self.pool.sharing(request.key.version))
        self._arrival_rate.add(request.arrival, 1)
        request.key.version.arrivals.add(request.arrival, 1)
        request.key.version.senders.heard(request.tenant, request.arrival)
        if not self._wakeup.is_set() and self.pool.free_count:
            self._wakeup.set()
        self._changed()

    def discard(self, request: QueuedRequest) -> None:
        """Forgets a request its handler is done with; it may have been answered while queued
        (timeout, disconnect), and then leaves the queue before any batch is formed."""
        if request.tier_rank == IDLE_RANK:
            if not request.running:
                self.idle.discard(request)
                self._changed()  # the last line gone: online waiting may stop counting
            return
        lane = None if request.running else self._lanes.get(request.key)  # ran: not queued
        if lane is not None and lane.queue.discard(request):
            self._queued -= 1
            if not lane.queue:
                del self._lanes[lane.key]
        self._changed()

    def fail_queued(self, error: BatchserveError, version: ModelVersion | None = None) -> None:
        """Answers every waiting request (of `version`, if given) with `error`."""
        lanes = [lane for lane in self._lanes.values() if version in (None, lane.key.version)]
        waiting = self._rescue.waiting(version)
        for request in itertools.chain(*(lane.queue for lane in lanes), waiting):
            if not request.future.done():
                request.future.set_exception(error)
        for lane in lanes:
            self._queued -= len(lane.queue)
            del self._lanes[lane.key]
        self._rescue.drop(version)
        self.pool.prepared.withdraw(None if version is None else {version})
        self.idle.fail(error, version)
        self._changed()

    # The pool's callbacks: it tells what happened to a batch or a device.

    def batch_done(self, batch: list[QueuedRequest], started: float, finished: float) -> None:
        """`batch`'s call succeeded and its device is free; nobody is answered yet."""
        answered = len(batch)
        if batch and batch[0].tier_rank == IDLE_RANK:
            self.idle.ended(answered, finished - started)
            self._prepare_idle()
        self._completed += answered
        self._drain_rate.add(finished, answered)
        self._wakeup.set()
        self._changed()
        if self._on_batch_ran is not None:
            self._on_batch_ran(batch, started, finished)

    def batch_failed(self, batch: list[QueuedRequest], key: Key, failure: BatchFailure) -> None:
        """Hands a failed batch to its rescue, which plans what runs again."""
        if batch and batch[0].tier_rank == IDLE_RANK:
            self.idle.ended(len(batch), None)
        elif self.pool.prepared:  # its rescue may wait for the device: online work
            self.pool.prepared.withdraw(self.pool.sharing(key.version))
        self._rescue.batch_failed(batch, key, failure)
        self._wakeup.set()
        self._changed()

    def health_changed(self) -> None:
        """Fails what no healthy device is left to run."""
        if not self.pool.healthy:
            self.fail_queued(NotReady("no healthy device is left to run this request"))
        waiting = itertools.chain(self._lanes, (key for key, _ in self._rescue.groups()))
        for version in {key.version for key in waiting} | self.idle.versions():
            if not self.pool.healthy_for(version):
                self.fail_queued(
                    NotReady(f"no healthy device is left to run {version.spec.label}"), version
                )
        self._wakeup.set()
        self._changed()

    async def wait_until(self, predicate: Callable[[BatcherStats], bool]) -> None:
        """Returns once `predicate(stats())` holds: for draining, and for tests."""
        await self._watchers.wait_until(predicate)

    def _changed(self) -> None:
        """Counts online waiting (while lines wait, or always where asked: it costs every
        change), then tells the waiters."""
        counting = bool(self.idle) or self._count_online_wait
        if counting or self._online_wait.open:
            waiting = counting and self._online_waits_on_a_free_device()
            self._online_wait.update(waiting, self._clock.time)
        self._watchers.changed()

    def _online_waits_on_a_free_device(self) -> bool:
        """Whether a device stands free that idle lines may not use, since online requests
        wait for its versions (`_idle_batch`'s rule): the cheap questions first, since this
        is asked at every change."""
        if not (self._queued > 0 or self._rescue.any_waiting) or self.pool.free_count == 0:
            return False
        return self.pool.all_shared or self.pool.free_only_for(self._busy_online())

    def arrival_rps(self, now: float) -> float:
        return self._arrival_rate.at(now)

    def capacity_rps(self, version: ModelVersion | None = None) -> float | None:
        return self._throughput.rps(version)

    def _drain_time_s(self) -> float:
        rate = self._drain_rate.at(self._clock.time())
        return self._queued / rate if rate > 0 else 1.0

    async def _run(self) -> None:
        clock, rescue = self._clock, self._rescue
        while True:
            self._wakeup.clear()
            now = clock.time()
            if rescue.paid_waiting and (retry := rescue.take_retry(now)) is not None:
                self._send(*retry)
                continue
            lane, count, wake_at, reason = self._choose(now)
            if lane is not None:
                riders = rescue.riders(lane, count, now)
                batch = self._take(lane, min(count, lane.max_batch - len(riders)), now)
                rescue.first_try_sent(now, backlog=len(lane.queue) >= lane.max_batch)
                self._send(lane.key, batch + riders, reason)
                continue
            if rescue.spare_waiting and (spare := rescue.take_spare(now, self._taker(now))):
                self._send(*spare)
                continue
            if self.idle and (lines := self._idle_batch()) is not None:
                self._send(*lines, "idle")
                continue
            alarm = None if wake_at is None else clock.call_at(wake_at, self._wakeup.set)
            await self._wakeup.wait()
            if alarm is not None:
                alarm.cancel()

    def _idle_batch(self) -> tuple[Key, list[QueuedRequest]] | None:
        """Batch API lines for a free device that no online request waits for: none of the
        versions sharing it has a request queued or to be retried."""
        taken = self.idle.take(self._busy_online(), self.pool.free_for, _limits)
        if taken is None:
            return None
        key, lines = taken
        return key, still_waiting(lines, self._clock.time())

    def _busy_online(self) -> set[ModelVersion]:
        """The versions online requests wait for, and those sharing a device with them."""
        waiting = itertools.chain(self._lanes, (key for key, _ in self._rescue.groups()))
        return {shared for key in waiting for shared in self.pool.sharing(key.version)}

    def _prepare_idle(self) -> None:
        """On each device whose call in hand is an idle one, the next idle call of its
        version, prepared to start as it returns (`devices/prepared.py`), if no online
        request waits for that version."""
        devices = self.pool.prepared.chainable(self.pool.devices) if self.idle else []
        busy = self._busy_online() if devices else set()
        for device in devices:
            assert device.key is not None  # it has a call in hand
            taken = self.idle.take(busy, {device.key.version}.__contains__, _limits)
            if taken is None:
                continue
            key, lines = taken
            lines = still_waiting(lines, self._clock.time())
            if lines:
                self.idle.hold(len(lines))
                if not self.pool.prepared.prepare(device, key, lines):
                    self.idle.back(key, lines)

    def _idle_started(self, key: Key, batch: list[QueuedRequest]) -> int:
        """A prepared idle call started: counted as sent; its batch id."""
        self.idle.sent(len(batch), held=True)
        return self._count(key, batch)

    def _taker(self, now: float) -> Callable[[LaneView, int], list[QueuedRequest]]:
        """`_take` at `now`, for a rescue group that takes its lane's requests along."""
        return lambda lane, count: self._take(self._lanes[lane.key], count, now)

    def _send(self, key: Key, batch: list[QueuedRequest], reason: FlushReason = "rescue") -> None:
        """Starts `batch` on a device; `reason`, why it leaves, is for its trace span (the
        rescue calls pass none)."""
        if batch:
            idle = batch[0].tier_rank == IDLE_RANK
            if idle:
                self.idle.sent(len(batch))
            self.pool.dispatch(batch, self._count(key, batch), key, reason)
            if idle:
                self._prepare_idle()
        self._changed()

    def _count(self, key: Key, batch: list[QueuedRequest]) -> int:
        """Counts a batch sent; its id."""
        self._batches += 1
        self.batch_sizes[len(batch)] += 1
        model, version = key.version.name, key.version.version
        self.batch_fill[model, version, "batches"] += 1
        self.batch_fill[model, version, "requests"] += len(batch)
        return self._batches

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
            free = self.pool.free_for(lane.key.version)
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
                    device_share=self._throughput.device_share(lane.key.version, now),
                )
                decision = lane.key.version.policy.decide(
                    now, view, free, self.pool.busy_since_of(lane.key)
                )
                count, reason = min(decision.dispatch, lane.max_batch), decision.reason
                if not count:
                    if decision.wake_at is not None:
                        wake_at = (
                            decision.wake_at if wake_at is None else min(wake_at, decision.wake_at)
                        )
                    continue
            if self._shared_ratio:
                count = lane.shared(count, self._shared_ratio, now)
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

    def _take(self, lane: Lane, count: int, now: float) -> list[QueuedRequest]:
        """`count` requests in batch order; expired ones are answered 504 instead."""
        taken = lane.queue.take(count)
        self._queued -= len(taken)
        if not lane.queue:
            del self._lanes[lane.key]
        return still_waiting(taken, now)


def _limits(key: Key) -> Lane:
    """What an idle call's size is read from: the lane `key` would have."""
    return Lane(key, 0.0)
