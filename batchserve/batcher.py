"""The batching loop: a thin coroutine that asks the policy when to send, and sends.

The batcher owns the queue of accepted requests (oldest first), the retry lane in front of it
(groups from failed batches, run again as they are, before anything new) and the one task
that forms batches. It wakes only when something could change the answer: a request arrives
while a device is free, a device frees or fails, or the policy's own wake-up time comes.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from .capacity import CallTime, DecayedRate
from .clock import Clock
from .errors import BackendError, BatchserveError, NotReady, Overloaded
from .fair_queue import TIER_RANKS, FairQueue, predicted_wait_s
from .faults import BatchFailure, RetryBudget, plan_recovery
from .gpu_pool import GpuPool
from .item import QueuedRequest
from .policy import Decision, Policy, QueueView
from .tasks import CrashHandler, TaskSet

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


class Batcher:
    """Hears from the engine of finished and failed batches and of health changes."""

    def __init__(
        self,
        policy: Policy,
        pool: GpuPool,
        *,
        clock: Clock,
        call_time: CallTime,
        max_batch_size: int,
        max_queue: int,
        bisect_failures: bool,
        retry_budget: RetryBudget,
        shed: bool,
        on_crash: CrashHandler,
    ):
        self._policy = policy
        self._pool = pool
        self._clock = clock
        self._call_time = call_time
        self._max_batch_size = max_batch_size
        self._max_queue = max_queue
        self._bisect = bisect_failures
        self._retry_budget = retry_budget
        self._queue = FairQueue()
        self._shed = shed
        self._retries: deque[list[QueuedRequest]] = deque()
        self.recoveries: Counter[str] = Counter()
        """Requests sent round again by kind of failure, and those answered 500."""
        self._wakeup = asyncio.Event()
        self._tasks = TaskSet(on_crash)
        self._watchers: list[tuple[Callable[[BatcherStats], bool], asyncio.Future[None]]] = []
        self._batches = 0
        self._completed = 0
        self._drain_rate = DecayedRate()
        self._arrival_rate = DecayedRate()
        self._tier_rates = [DecayedRate() for _ in TIER_RANKS]
        """Arrivals a second by tier rank: what higher tiers will claim of the capacity."""
        self.batch_sizes: Counter[int] = Counter()
        """How many batches of each size were sent, retries included."""

    def __repr__(self) -> str:
        s = self.stats()
        return f"<Batcher queued={s.queued} in_flight={s.in_flight} batches={s.batches}>"

    def stats(self) -> BatcherStats:
        return BatcherStats(
            queued=len(self._queue) + self._retrying(),
            in_flight=self._pool.in_flight_requests,
            free_devices=self._pool.free_count,
            healthy_devices=self._pool.healthy,
            batches=self._batches,
            completed=self._completed,
        )

    async def __aenter__(self) -> Batcher:
        self._tasks.start(self._run(), name="batchserve-batcher")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._tasks.aclose()

    def submit(self, request: QueuedRequest) -> None:
        if len(self._queue) >= self._max_queue:
            raise Overloaded(
                f"the queue holds its limit of {self._max_queue} requests",
                retry_after_s=self._drain_time_s(),
            )
        if self._shed:
            self._refuse_if_late(request)
            self._tier_rates[request.tier_rank].add(request.arrival, 1)
        self._queue.push(request)
        self._arrival_rate.add(request.arrival, 1)
        if self._pool.free_count:
            self._wakeup.set()
        self._changed()

    def discard(self, request_id: str) -> None:
        """Forgets a request its handler is done with; it may have been answered while queued
        (timeout, disconnect), and then leaves the queue before any batch is formed."""
        self._queue.discard(request_id)
        self._changed()

    def fail_queued(self, error: BatchserveError) -> None:
        for request in itertools.chain(self._queue, *self._retries):
            if not request.future.done():
                request.future.set_exception(error)
        self._queue.clear()
        self._retries.clear()
        self._changed()

    def batch_done(self, finished: float, answered: int) -> None:
        self._completed += answered
        self._drain_rate.add(finished, answered)
        self._wakeup.set()
        self._changed()

    def batch_failed(self, batch: list[QueuedRequest], failure: BatchFailure) -> None:
        recovery = plan_recovery(
            batch, failure.kind, bisect=self._bisect, budget=self._retry_budget
        )
        for group in recovery.retry:
            for request in group:
                request.running = False
        self._retries.extendleft(reversed(recovery.retry))
        self.recoveries[f"retried_{failure.kind.value}"] += sum(map(len, recovery.retry))
        error = failure.error
        if recovery.unpaid:
            self.recoveries["not_retried_over_budget"] += len(recovery.fail)
            error = BackendError(
                f"{error}; not retried, so innocent inputs may share this answer:"
                " too many batches are failing (see --retry-budget)"
            )
        for request in recovery.fail:
            if not request.future.done():
                request.future.set_exception(error)
                self.recoveries["failed"] += 1
        self._wakeup.set()
        self._changed()

    def health_changed(self) -> None:
        if not self._pool.healthy:
            self.fail_queued(NotReady("no healthy device is left to run this request"))
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

    def _refuse_if_late(self, request: QueuedRequest) -> None:
        """Sheds a request predicted to miss its deadline: the lowest tiers first, since
        every higher tier's queued requests are ahead of theirs, and the higher tiers' new
        arrivals will take their share of the capacity meanwhile."""
        ahead = (
            self._queue.ahead_of(request.tenant, request.tier_rank, request.tenant_weight)
            + self._retrying()
        )
        capacity, call_s = self.capacity_rps(), self._call_time.seconds
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

    def capacity_rps(self) -> float | None:
        """Requests a second the healthy devices can take in full batches; None until a batch
        has finished, since the call time is measured, not assumed."""
        call_s = self._call_time.seconds
        if not call_s:
            return None
        return self._pool.healthy * self._max_batch_size / call_s

    def predicted_queue_wait_s(self, queued: int) -> float:
        """How long a request arriving now would wait for the `queued` ahead of it to drain."""
        capacity = self.capacity_rps()
        if not queued:
            return 0.0
        return queued / capacity if capacity else math.inf

    def _retrying(self) -> int:
        """Requests in the retry lane, which batches take before the queue."""
        return sum(map(len, self._retries))

    def _drain_time_s(self) -> float:
        rate = self._drain_rate.at(self._clock.time())
        return len(self._queue) / rate if rate > 0 else 1.0

    async def _run(self) -> None:
        clock = self._clock
        while True:
            self._wakeup.clear()
            now = clock.time()
            if self._retries and self._pool.free_count:
                self._send(self._live(self._retries.popleft(), now))
                continue
            decision = self._decide(now)
            if decision.dispatch:
                self._send(self._take(decision.dispatch, now))
                # Retries are paid from spare capacity only: none accrues while a backlog
                # of a full batch or more is left waiting.
                if len(self._queue) < self._max_batch_size:
                    self._retry_budget.on_first_try()
                continue
            wake_at = decision.wake_at
            alarm = None if wake_at is None else clock.call_at(wake_at, self._wakeup.set)
            await self._wakeup.wait()
            if alarm is not None:
                alarm.cancel()

    def _send(self, batch: list[QueuedRequest]) -> None:
        if batch:
            self._batches += 1
            self.batch_sizes[len(batch)] += 1
            self._pool.dispatch(batch, self._batches)
        self._changed()

    def _decide(self, now: float) -> Decision:
        free = self._pool.free_count
        if not self._queue or not free:
            return self._policy.decide(now, QueueView(len(self._queue)), free, [])
        head = self._queue.head(self._max_batch_size)
        view = QueueView(
            size=len(self._queue),
            oldest_arrival=head[0].arrival,
            earliest_deadline=min(request.deadline for request in head),
        )
        return self._policy.decide(now, view, free, self._pool.busy_since)

    def _take(self, count: int, now: float) -> list[QueuedRequest]:
        """`count` requests in batch order; expired ones are answered 504 instead."""
        return [request for request in self._queue.take(count) if _waiting(request, now)]

    def _live(self, group: list[QueuedRequest], now: float) -> list[QueuedRequest]:
        return [request for request in group if _waiting(request, now)]


def _waiting(request: QueuedRequest, now: float) -> bool:
    """False for a request already answered; one whose deadline passed is answered 504."""
    if request.deadline <= now:
        request.expire()
    return not request.future.done()
