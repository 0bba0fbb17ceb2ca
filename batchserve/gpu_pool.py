"""Devices, their threads and their health: each device runs one batch call at a time.

The pool loads each device's batch function on that device's thread (so weights land where
they will be used), runs batches there, checks what comes back and resolves the waiting
futures on the event loop. A failed batch goes back to its listener (the engine, which hands
it to the batcher to decide what runs again). A call past its budget marks its device hung:
the device gets no work until that call has returned and a probe has answered in time. The
pool owns every task it starts and cancels what is left of them on close. Each successful
call's duration goes into the engine's one batch-time estimate; all timing reads its clock.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

from .backends import BatchFn, DeviceFactory
from .capacity import CallTime
from .clock import Clock, Timer, sleep_until, wait_until
from .device_thread import DeviceThread
from .errors import BackendError, BatchserveError, StartupError
from .faults import MAX_PROBE_DELAY_S, PROBE_INPUT, BatchBudget, BatchFailure, FailureKind
from .item import QueuedRequest, Result
from .tasks import CrashHandler, TaskSet

log = logging.getLogger(__name__)


class PoolListener(Protocol):
    def batch_done(self, finished: float, answered: int) -> None:
        """A batch succeeded at `finished` and its device is free; called before anyone is
        answered."""

    def batch_failed(self, batch: list[QueuedRequest], failure: BatchFailure) -> None:
        """Nobody in `batch` has been answered; the listener retries or fails them."""

    def health_changed(self) -> None:
        """A device went unhealthy or came back."""


class DeviceState(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"
    HUNG = "hung"
    """A call ran past its budget and has not returned; the thread cannot be killed."""
    RECOVERING = "recovering"
    """The hung call returned; probes run after a back-off until one answers in time."""
    DEAD = "dead"
    """Its batch function failed to load."""


HEALTHY = frozenset({DeviceState.IDLE, DeviceState.BUSY})
BUSY_WINDOW_S = 10.0
LOGGED_IDS = 5
"""A failed batch's log line names this many request ids and counts the rest."""


@dataclass(eq=False)
class Device:
    name: str
    thread: DeviceThread
    fn: BatchFn | None = None
    state: DeviceState = DeviceState.IDLE
    busy_since: float | None = None
    batch: list[QueuedRequest] = field(default_factory=list)
    busy_total_s: float = 0.0
    """Time spent in finished batch calls, for the busy ratio."""
    recent_calls: deque[tuple[float, float]] = field(default_factory=deque)
    """(start, end) of the calls that ended in the last BUSY_WINDOW_S."""

    def busy_ratio(self, now: float) -> float:
        """Share of the last BUSY_WINDOW_S spent inside batch calls."""
        since = now - BUSY_WINDOW_S
        while self.recent_calls and self.recent_calls[0][1] <= since:
            self.recent_calls.popleft()
        busy = sum(end - max(start, since) for start, end in self.recent_calls)
        if self.busy_since is not None:
            busy += now - max(self.busy_since, since)
        return min(1.0, busy / BUSY_WINDOW_S)


class GpuPool:
    def __init__(
        self,
        device_names: list[str],
        factory: DeviceFactory,
        *,
        clock: Clock,
        call_time: CallTime,
        budget: BatchBudget,
        listener: PoolListener,
        on_crash: CrashHandler,
    ) -> None:
        self._factory = factory
        self._clock = clock
        self._call_time = call_time
        self._budget = budget
        self._listener = listener
        self._devices = [Device(name, DeviceThread(name)) for name in device_names]
        self._tasks = TaskSet(on_crash)
        self.healthy = 0
        self.faults: Counter[str] = Counter()
        """Faults by kind, counted in the logs and on /metrics."""

    def __repr__(self) -> str:
        return (
            f"<GpuPool devices={len(self._devices)} healthy={self.healthy} free={self.free_count}>"
        )

    @property
    def free_count(self) -> int:
        return sum(device.state is DeviceState.IDLE for device in self._devices)

    @property
    def busy_since(self) -> list[float]:
        return [d.busy_since for d in self._devices if d.busy_since is not None]

    @property
    def in_flight_requests(self) -> int:
        """Requests running and still unanswered (a deadline may have answered one)."""
        return sum(not r.future.done() for device in self._devices for r in device.batch)

    @property
    def devices(self) -> list[Device]:
        return list(self._devices)

    def states(self) -> dict[str, str]:
        return {device.name: device.state.value for device in self._devices}

    async def __aenter__(self) -> GpuPool:
        loop = asyncio.get_running_loop()
        for device in self._devices:
            device.thread.start(loop)
        loaded = await asyncio.gather(
            *(d.thread.submit(self._factory, d.name) for d in self._devices),
            return_exceptions=True,
        )
        failures: list[str] = []
        for device, fn in zip(self._devices, loaded, strict=True):
            if isinstance(fn, BaseException):
                cause = fn if isinstance(fn, StartupError) else f"{type(fn).__name__}: {fn}"
                failures.append(f"device {device.name} failed to load: {cause}")
                device.state = DeviceState.DEAD
                device.thread.stop()
                self.faults["device_dead"] += 1
            else:
                device.fn = fn
        self.healthy = len(self._devices) - len(failures)
        if not self.healthy:
            for device in self._devices:
                device.thread.stop()
            raise StartupError("no device loaded: " + "; ".join(failures))
        for failure in failures:
            log.error("%s; serving on the other devices", failure)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Cancels what is left: probes, and calls nobody waits for after the drain."""
        await self._tasks.aclose()
        for device in self._devices:
            device.thread.stop()

    def dispatch(self, batch: list[QueuedRequest], batch_id: int) -> None:
        """Starts `batch` on a free device; the caller has checked that one is free."""
        device = next(d for d in self._devices if d.state is DeviceState.IDLE)
        assert device.fn is not None
        device.state = DeviceState.BUSY
        device.busy_since = started = self._clock.time()
        device.batch = batch
        for request in batch:
            request.running = True
        # Submitted here, not in the task's first step: that step would queue behind every
        # handler that the last finished batch just woke, leaving the device idle meanwhile.
        call = device.thread.submit(device.fn, [r.input for r in batch])
        # A plain timer, not asyncio.wait: that would add a loop pass between the call's end
        # and this device's next batch, and under load each pass waits behind every handler.
        budget_s = self._budget.seconds()
        watchdog = self._clock.call_at(
            started + budget_s, self._hung, device, batch, batch_id, budget_s
        )
        self._tasks.start(
            self._finish(device, batch, batch_id, started, call, watchdog),
            name=f"batchserve-batch-{batch_id}",
        )

    def fail_in_flight(self, error: BatchserveError) -> None:
        """Answers everyone whose batch is still running; late results are then dropped."""
        for device in self._devices:
            for request in device.batch:
                if not request.future.done():
                    request.future.set_exception(error)

    async def _finish(
        self,
        device: Device,
        batch: list[QueuedRequest],
        batch_id: int,
        started: float,
        call: asyncio.Future[list[str]],
        watchdog: Timer,
    ) -> None:
        try:
            returned: object = await call
        except Exception as exc:
            returned = exc
        watchdog.cancel()
        if device.state is DeviceState.HUNG:  # the watchdog already handed the batch back
            await self._recover(device)
            return
        finished = self._clock.time()
        device.state = DeviceState.IDLE
        device.busy_since = None
        device.batch = []
        device.busy_total_s += finished - started
        device.recent_calls.append((started, finished))
        if isinstance(returned, Exception):
            error = BackendError(f"the batch function raised {type(returned).__name__}: {returned}")
            self._failed(batch, BatchFailure(FailureKind.RAISED, error, device.name, batch_id))
            return
        try:
            outputs = _checked(returned, len(batch))
        except BackendError as exc:
            self._failed(batch, BatchFailure(FailureKind.MALFORMED, exc, device.name, batch_id))
            return
        self._call_time.observe(finished - started)
        # Wake the batcher before the waiting handlers: its wake-up is then queued ahead of
        # theirs, so the device gets its next batch before a hundred responses are written.
        self._listener.batch_done(finished, len(batch))
        for request, output in zip(batch, outputs, strict=True):
            if not request.future.done():
                request.future.set_result(
                    Result(
                        output,
                        started - request.arrival,
                        finished - started,
                        len(batch),
                        batch_id,
                        device.name,
                    )
                )

    def _failed(self, batch: list[QueuedRequest], failure: BatchFailure, then: str = "") -> None:
        self.faults[f"batch_{failure.kind.value}"] += 1
        ids = ",".join(r.request_id for r in batch[:LOGGED_IDS])
        if len(batch) > LOGGED_IDS:
            ids += f" and {len(batch) - LOGGED_IDS} more"
        log.warning(
            "batch %d of %d on %s failed: %s%s; request ids: %s",
            failure.batch_id,
            len(batch),
            failure.device,
            failure.error,
            then,
            ids,
        )
        self._listener.batch_failed(batch, failure)

    def _hung(
        self, device: Device, batch: list[QueuedRequest], batch_id: int, budget_s: float
    ) -> None:
        device.state = DeviceState.HUNG
        device.busy_since = None
        device.batch = []
        self.healthy -= 1
        error = BackendError(
            f"the batch call on {device.name} ran past its budget of {budget_s * 1e3:.0f} ms"
        )
        self._failed(
            batch,
            BatchFailure(FailureKind.HUNG, error, device.name, batch_id),
            then="; the device gets no work until a probe answers in time",
        )
        self._listener.health_changed()

    async def _recover(self, device: Device) -> None:
        """After a hung call returns (its results are dropped), probes until one answers."""
        self.faults["late_result_discarded"] += 1
        log.warning("the hung call on %s returned; its results were discarded", device.name)
        device.state = DeviceState.RECOVERING
        delay_s = self._budget.seconds()
        while True:
            await sleep_until(self._clock, self._clock.time() + delay_s)
            if await self._probe(device):
                break
            delay_s = min(2 * delay_s, MAX_PROBE_DELAY_S)
        device.state = DeviceState.IDLE
        self.healthy += 1
        self.faults["device_recovered"] += 1
        log.warning("%s answered its probe in time and takes work again", device.name)
        self._listener.health_changed()

    async def _probe(self, device: Device) -> bool:
        assert device.fn is not None
        budget_s = self._budget.seconds()
        call = device.thread.submit(device.fn, [PROBE_INPUT])
        if await wait_until(self._clock, call, self._clock.time() + budget_s):
            try:
                _checked(call.result(), 1)
                return True
            except Exception as exc:
                problem = f"failed: {type(exc).__name__}: {exc}"
        else:
            problem = f"ran past {budget_s * 1e3:.0f} ms"
            device.state = DeviceState.HUNG
            await asyncio.wait((call,))  # never a second call while one is inside
            device.state = DeviceState.RECOVERING
        self.faults["probe_failed"] += 1
        log.warning("the probe of %s %s", device.name, problem)
        return False


def _checked(returned: object, expected: int) -> list[str]:
    if not isinstance(returned, list):
        raise BackendError(
            f"the batch function returned {type(returned).__name__}, not a list of str"
        )
    if len(returned) != expected:
        raise BackendError(
            f"the batch function returned {len(returned)} outputs for {expected} inputs"
        )
    wrong = [type(item).__name__ for item in returned if not isinstance(item, str)]
    if wrong:
        raise BackendError(f"the batch function returned a {wrong[0]} output, not str")
    return returned
