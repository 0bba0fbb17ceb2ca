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
import functools
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import orjson

from .batching.faults import MAX_PROBE_DELAY_S, PROBE_INPUT, BatchFailure, FailureKind
from .batching.request import QueuedRequest, Result
from .clock import Clock, Timer, sleep_until, wait_until
from .devices.thread import DeviceThread
from .errors import BackendError, BatchserveError, StartupError
from .models.registry import Key, ModelVersion
from .models.specs import DEFAULT_MODEL, BatchFn
from .tasks import CrashHandler, TaskSet

log = logging.getLogger(__name__)


class PoolListener(Protocol):
    def batch_done(self, batch: list[QueuedRequest], started: float, finished: float) -> None:
        """`batch`'s call, from `started`, succeeded at `finished` and its device is free;
        called before anyone is answered."""

    def batch_failed(self, batch: list[QueuedRequest], key: Key, failure: BatchFailure) -> None:
        """Nobody in `batch` (all of `key`) has been answered; the listener retries or fails
        them."""

    def health_changed(self) -> None:
        """A device went unhealthy or came back."""


class BatchCall(NamedTuple):
    """A batch call that returned, as the pool's `on_call` hears of it (its trace span)."""

    batch: list[QueuedRequest]
    batch_id: int
    device: str
    started: float
    finished: float
    reason: str
    """Why the batch left (rules/policy.py's FlushReason)."""
    error: str | None
    """None: it answered its batch; else why not: the type of what it raised, or "hung"
    (the watchdog handed the batch on; the call returned late)."""


class DeviceState(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"
    HUNG = "hung"
    """A call ran past its budget and has not returned; the thread cannot be killed."""
    RECOVERING = "recovering"
    """The hung call returned; probes run after a back-off until one answers in time."""
    DEAD = "dead"
    """Its batch function failed to load."""
    SUSPECT = "suspect"
    """It failed two first tries in a row (batches of requests that had not failed
    before) while no other device failed one: it takes no work until a probe with a
    known-good input says whether it, or two poison inputs, were to blame."""
    FAILING = "failing"
    """Its calls kept raising on different inputs: it is being restarted (its batch
    functions loaded again on a fresh thread, then probed), backing off while that fails."""


HEALTHY = frozenset({DeviceState.IDLE, DeviceState.BUSY, DeviceState.SUSPECT})
"""A suspect device still counts: its probe takes one short call, and a lone device
suspected after two poison inputs must not fail everything queued as not ready."""
BUSY_WINDOW_S = 10.0
LOGGED_IDS = 5
"""A failed batch's log line names this many request ids and counts the rest."""
FAILING_BLAME = 2
"""A device is failing once this many of its failed calls (since its last success) had
every input succeed on another device: the device, not an input, was to blame. A poison
input never succeeds anywhere, so poison alone never marks a device failing."""
MAX_FAILURES_KEPT = 64
FIRST_RESTART_DELAY_S = 1.0
"""A device that fails to restart waits this long before the next try, then doubles."""


@dataclass(eq=False)
class Device:
    name: str
    thread: DeviceThread
    fns: dict[ModelVersion, BatchFn] = field(default_factory=dict)
    """The batch function of each model version loaded here."""
    state: DeviceState = DeviceState.IDLE
    busy_since: float | None = None
    key: Key | None = None
    """The compatibility key of the batch running now."""
    batch: list[QueuedRequest] = field(default_factory=list)
    busy_total_s: float = 0.0
    """Time spent in finished batch calls, for the busy ratio."""
    recent_calls: deque[tuple[float, float]] = field(default_factory=deque)
    """(start, end) of the calls that ended in the last BUSY_WINDOW_S."""
    failures: list[set[Who]] = field(default_factory=list)
    """Per failed call since its last success, the requests not yet answered elsewhere
    (at most MAX_FAILURES_KEPT calls)."""
    failed_first_tries: int = 0
    """Its failed calls since its last success that held no request that had failed before
    (a rescue, or a rider, fails again where its poison is): two make it suspect."""
    streak_from: int = 0
    """The pool's count of failed first tries when this device's streak of them began."""
    blame: int = 0
    """Its failed calls since its last success whose every input then succeeded elsewhere."""
    turns: deque[asyncio.Future[bool]] = field(default_factory=deque)
    """Calls of the pool's own (a new version's warm-up) waiting for the device to be free:
    each takes it before the batcher can, once the call inside has returned."""

    def call_ended(self, started: float, finished: float) -> None:
        """Counts a call in the busy ratio; the window drops what it no longer covers here
        too, not only when the ratio is read (by a scrape that may never come)."""
        self.busy_total_s += finished - started
        self.recent_calls.append((started, finished))
        self._forget_calls_before(finished - BUSY_WINDOW_S)

    def busy_ratio(self, now: float) -> float:
        """Share of the last BUSY_WINDOW_S spent inside batch calls."""
        since = now - BUSY_WINDOW_S
        self._forget_calls_before(since)
        busy = sum(end - max(start, since) for start, end in self.recent_calls)
        if self.busy_since is not None:
            busy += now - max(self.busy_since, since)
        return min(1.0, busy / BUSY_WINDOW_S)

    def _forget_calls_before(self, since: float) -> None:
        while self.recent_calls and self.recent_calls[0][1] <= since:
            self.recent_calls.popleft()


class GpuPool:
    """The physical devices, shared by every model version placed on them."""

    def __init__(
        self,
        versions: list[ModelVersion],
        *,
        clock: Clock,
        listener: PoolListener,
        on_crash: CrashHandler,
    ) -> None:
        self._versions = versions
        self._clock = clock
        self._listener = listener
        names = dict.fromkeys(name for v in versions for name in v.device_names)
        self._devices = [Device(name, DeviceThread(name)) for name in names]
        self._tasks = TaskSet(on_crash)
        self.healthy = 0
        self._failed_first_tries = 0
        """First tries failed on any device: a suspect's streak must be its own."""
        self._sharing: dict[ModelVersion, frozenset[ModelVersion]] = {}
        """`sharing`'s answers, until a load or unload changes what the devices hold."""
        self.faults: Counter[str] = Counter()
        """Faults by kind, counted in the logs and on /metrics."""
        self.on_call: Callable[[BatchCall], None] | None = None
        """Told of each batch call as it returns, before anyone is answered (tracing)."""

    def __repr__(self) -> str:
        return (
            f"<GpuPool devices={len(self._devices)} healthy={self.healthy} free={self.free_count}>"
        )

    @property
    def free_count(self) -> int:
        # Counted in a list, not summed over a generator: the batcher asks at every arrival.
        return [device.state for device in self._devices].count(DeviceState.IDLE)

    def free_for(self, version: ModelVersion) -> int:
        """Free devices that can run `version`."""
        return sum(d.state is DeviceState.IDLE and version in d.fns for d in self._devices)

    def healthy_for(self, version: ModelVersion) -> int:
        return sum(d.state in HEALTHY and version in d.fns for d in self._devices)

    def free_avoiding(self, version: ModelVersion, avoid: tuple[str, ...]) -> int:
        """Free devices that can run `version`, other than those named in `avoid`."""
        return sum(
            d.state is DeviceState.IDLE and version in d.fns and d.name not in avoid
            for d in self._devices
        )

    def healthy_avoiding(self, version: ModelVersion, avoid: tuple[str, ...]) -> int:
        return sum(
            d.state in HEALTHY and version in d.fns and d.name not in avoid for d in self._devices
        )

    def sharing(self, version: ModelVersion) -> frozenset[ModelVersion]:
        """The versions loaded on any device `version` is on, itself included."""
        neighbours = self._sharing.get(version)
        if neighbours is None:
            neighbours = self._sharing[version] = frozenset(
                v for d in self._devices if version in d.fns for v in d.fns
            )
        return neighbours

    def busy_since_of(self, key: Key) -> list[float]:
        """Start times of the batches of `key` running now: what its spacing counts from."""
        return [
            d.busy_since
            for d in self._devices
            if d.busy_since is not None and (d.key is key or d.key == key)
        ]

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
        """Loads every version on each of its devices (on that device's thread, so weights
        land where they run); a device where nothing loaded is dead."""
        loop = asyncio.get_running_loop()
        for device in self._devices:
            device.thread.start(loop)
        problems: list[str] = []
        for version in self._versions:
            problems += await self.load(version)
        for device in self._devices:
            if not device.fns:
                device.state = DeviceState.DEAD
                device.thread.stop()
                self.faults["device_dead"] += 1
        self.healthy = sum(device.state in HEALTHY for device in self._devices)
        unloaded = [v.spec.label for v in self._versions if not v.loaded_on]
        if unloaded:
            for device in self._devices:
                device.thread.stop()
            if [v.name for v in self._versions] == [DEFAULT_MODEL]:
                raise StartupError("no device loaded: " + "; ".join(problems))
            raise StartupError(f"{', '.join(unloaded)} loaded on no device: " + "; ".join(problems))
        for problem in problems:
            log.error("%s; serving on the other devices", problem)
        return self

    async def load(self, version: ModelVersion, *, beside_serving: bool = False) -> list[str]:
        """Calls `version`'s factory for each of its devices; returns what failed. At
        start-up each load runs on its device's thread. `beside_serving` (a version added
        while serving) loads on a thread of its own, so that the versions already on the
        device keep serving meanwhile, then runs a warm-up batch of one input on the
        device's own thread, in its turn (`_warm_up`); a device whose warm-up fails does
        not take the version."""
        devices = [
            d for d in self._devices if d.name in version.device_names and d.state in HEALTHY
        ]
        loads: list[Awaitable[BatchFn]] = [
            self._load_beside(version, d)
            if beside_serving
            else d.thread.submit(version.factory, d.name)
            for d in devices
        ]
        loaded = await asyncio.gather(*loads, return_exceptions=True)
        problems: list[str] = []
        for device, fn in zip(devices, loaded, strict=True):
            if isinstance(fn, BaseException):
                cause = fn if isinstance(fn, StartupError) else f"{type(fn).__name__}: {fn}"
                what = "" if version.name == DEFAULT_MODEL else f" {version.spec.label}"
                problems.append(f"device {device.name} failed to load{what}: {cause}")
                continue
            if not version.loaded_on:
                version.learn(fn)
            device.fns[version] = fn
            self._sharing.clear()
            version.loaded_on.append(device.name)
        return problems

    async def _load_beside(self, version: ModelVersion, device: Device) -> BatchFn:
        fn = await asyncio.to_thread(version.factory, device.name)
        await self._warm_up(device, fn)
        return fn

    async def _warm_up(self, device: Device, fn: BatchFn) -> None:
        """One input through `fn` on the device's own thread, once the device is free and
        taken for it: never beside a batch (the backend contract is one call at a time),
        and never queued on the thread ahead of a batch whose budget would then run out.
        Raises StartupError if the call fails or the device leaves service first."""
        if not await self._take_turn(device):
            raise StartupError("the device left service before its warm-up batch")
        try:
            run = functools.partial(_run_checked, fn, None)
            await device.thread.submit(run, [WARM_UP_INPUT])
        except Exception as exc:
            raise StartupError(f"its warm-up batch failed: {type(exc).__name__}: {exc}") from None
        finally:
            if not self._hand_turn(device):
                device.state = DeviceState.IDLE
                self._listener.health_changed()  # wakes the batcher for the free device

    async def _take_turn(self, device: Device) -> bool:
        """Takes the device (busy, holding no batch) for a call of the pool's own as soon
        as it is free; False if it leaves service first (hung, failing)."""
        if device.state not in HEALTHY:
            return False
        if device.state is DeviceState.IDLE and all(turn.done() for turn in device.turns):
            device.state = DeviceState.BUSY
            return True
        turn: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        device.turns.append(turn)
        return await turn

    def _hand_turn(self, device: Device) -> bool:
        """A device just freed goes to the first call of the pool's own that waits for it,
        not to the batcher; True if one took it."""
        while device.turns:
            turn = device.turns.popleft()
            if not turn.done():  # its waiter may have been cancelled
                device.state = DeviceState.BUSY
                turn.set_result(True)
                return True
        return False

    def _end_turns(self, device: Device) -> None:
        """The device left service: what waited for its turn does without it."""
        while device.turns:
            turn = device.turns.popleft()
            if not turn.done():
                turn.set_result(False)

    def unload(self, version: ModelVersion) -> None:
        """Drops `version`'s batch functions, so that its weights can be freed; the caller
        has made sure none of its batches runs."""
        for device in self._devices:
            device.fns.pop(version, None)
        version.loaded_on.clear()
        self._sharing.clear()

    def running(self, version: ModelVersion) -> bool:
        """Whether a batch of `version` is inside a device now."""
        return any(d.key is not None and d.key.version is version for d in self._devices)

    async def __aexit__(self, *exc_info: object) -> None:
        """Cancels what is left: probes, and calls nobody waits for after the drain."""
        await self._tasks.aclose()
        for device in self._devices:
            device.thread.stop()

    def dispatch(
        self, batch: list[QueuedRequest], batch_id: int, key: Key, reason: str = "policy"
    ) -> None:
        """Starts `batch` (every request of `key`) on a free device that runs its version;
        the caller has checked that one is free. `reason`: why it left, for `on_call`."""
        version = key.version
        device = next(d for d in self._devices if d.state is DeviceState.IDLE and version in d.fns)
        avoid = batch[-1].failed_on  # riding rescue groups, if any, come last
        if device.name in avoid:  # a rescue: another device, if one is free
            device = next(
                (
                    d
                    for d in self._devices
                    if d.state is DeviceState.IDLE and version in d.fns and d.name not in avoid
                ),
                device,
            )
        device.state = DeviceState.BUSY
        device.busy_since = started = self._clock.time()
        device.key = key
        device.batch = batch
        for request in batch:
            request.running = True
        # Submitted here, not in the task's first step: that step would queue behind every
        # handler that the last finished batch just woke, leaving the device idle meanwhile.
        run = functools.partial(_run_checked, device.fns[version], key.params)
        call = device.thread.submit(run, [r.input for r in batch])
        # A plain timer, not asyncio.wait: that would add a loop pass between the call's end
        # and this device's next batch, and under load each pass waits behind every handler.
        budget_s = version.call_budget_s(_padded(batch))
        watchdog = self._clock.call_at(
            started + budget_s, self._hung, device, batch, batch_id, budget_s
        )
        self._tasks.start(
            self._finish(device, batch, batch_id, started, call, watchdog, reason),
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
        call: asyncio.Future[list[Any]],
        watchdog: Timer,
        reason: str,
    ) -> None:
        try:
            returned: list[Any] | Exception = await call
        except Exception as exc:
            returned = exc
        watchdog.cancel()
        if self.on_call is not None:
            error = "hung" if device.state is DeviceState.HUNG else _error_type(returned)
            now = self._clock.time()
            self.on_call(BatchCall(batch, batch_id, device.name, started, now, reason, error))
        if device.state is DeviceState.HUNG:  # the watchdog already handed the batch back
            await self._recover(device)
            return
        key = device.key
        assert key is not None
        finished = self._clock.time()
        device.state = DeviceState.IDLE
        device.busy_since = None
        device.key = None
        device.batch = []
        device.call_ended(started, finished)
        key.version.device_time.add(finished, finished - started)
        if isinstance(returned, Exception):
            self._call_failed(device, batch, key, batch_id, returned)
            if device.state is DeviceState.IDLE:
                self._hand_turn(device)
            return
        device.failures.clear()
        device.blame = 0
        device.failed_first_tries = 0
        if batch[0].failed_on:  # a rescue: where it failed before may have been to blame
            self._exonerate(device, batch)
        outputs = returned
        version = key.version
        version.estimate.observe(finished - started, _padded(batch))
        self._hand_turn(device)
        # Wake the batcher before the waiting handlers: its wake-up is then queued ahead of
        # theirs, so the device gets its next batch before a hundred responses are written.
        self._listener.batch_done(batch, started, finished)
        # What every result of the batch shares, read once rather than once a request.
        compute_s, size, name = finished - started, len(batch), device.name
        model, model_version = version.name, version.version
        for request, output in zip(batch, outputs, strict=True):
            if not request.future.done():
                request.future.set_result(
                    Result(
                        output,
                        started - request.arrival,
                        compute_s,
                        size,
                        batch_id,
                        name,
                        model,
                        model_version,
                    )
                )

    def _call_failed(
        self,
        device: Device,
        batch: list[QueuedRequest],
        key: Key,
        batch_id: int,
        returned: Exception,
    ) -> None:
        """Counts the failure against the device, and hands the batch to the batcher: as
        the device's fault if this failure marks it failing."""
        shared: BackendError | None = None
        if isinstance(returned, Malformed):
            kind, error = FailureKind.MALFORMED, BackendError(str(returned))
        else:
            kind = FailureKind.RAISED
            raised = type(returned).__name__
            error = BackendError(f"the batch function raised {raised}: {returned}")
            shared = BackendError(
                f"the batch function raised {raised} on a batch this request shared with"
                " others; its message is in the server's log only, since it may name their"
                " inputs"
            )
        if not any(request.failed_on for request in batch):  # a first try
            if not device.failed_first_tries:
                device.streak_from = self._failed_first_tries
            device.failed_first_tries += 1
            self._failed_first_tries += 1
        # Two first tries in a row failed here and none anywhere else meanwhile: more likely
        # this device than two poison inputs. (Under a flood of poison, all devices fail.)
        suspect = (
            device.failed_first_tries >= 2
            and self._failed_first_tries - device.streak_from == device.failed_first_tries
        )
        for request in batch:
            request.failed_on += (device.name,)
        device.failures.append({_who(r) for r in batch})
        del device.failures[:-MAX_FAILURES_KEPT]
        if suspect and device.blame < FAILING_BLAME:
            # A broken device fails fast, so it is the free one most often: left in service
            # it would sink a fresh batch every few milliseconds until blame accrues.
            device.state = DeviceState.SUSPECT
            self._tasks.start(self._check(device), name=f"batchserve-check-{device.name}")
            self._failed(
                batch,
                key,
                BatchFailure(FailureKind.SUSPECT_DEVICE, error, device.name, batch_id, shared),
                then=f"; {device.name} failed its last first try too, and is probed",
            )
            return
        if device.blame < FAILING_BLAME:
            self._failed(batch, key, BatchFailure(kind, error, device.name, batch_id, shared))
            return
        self._mark_failing(device)
        self._failed(
            batch,
            key,
            BatchFailure(FailureKind.DEVICE_FAILING, error, device.name, batch_id, shared),
            then=f"; {device.name} is failing and restarts",
        )
        self._listener.health_changed()

    def _exonerate(self, device: Device, batch: list[QueuedRequest]) -> None:
        """A rescued batch succeeded on `device`: where its requests failed before, on other
        devices, a failed call none of whose inputs is left unanswered was the device's
        fault."""
        answered = {_who(r) for r in batch}
        names = {name for r in batch for name in r.failed_on} - {device.name}
        for other in self._devices:
            if other.name not in names:
                continue
            for failed in other.failures:
                failed -= answered
            other.blame += sum(not failed for failed in other.failures)
            other.failures = [failed for failed in other.failures if failed]
            if other.blame >= FAILING_BLAME and other.state is DeviceState.IDLE:
                self._mark_failing(other)
                self._listener.health_changed()

    async def _check(self, device: Device) -> None:
        """Probes a suspect device: one that fails a known-good input is broken and
        restarts; one that answers had two poison inputs in a row, and takes work again."""
        if await self._probe(device):
            device.state = DeviceState.IDLE
            self._hand_turn(device)
            device.failed_first_tries = 0
            self.faults["device_cleared"] += 1
            log.warning("%s answered its probe after two failed first tries; it takes work again",
                        device.name)  # fmt: skip
            self._listener.health_changed()
            return
        device.state = DeviceState.SUSPECT  # a probe that hung left it recovering
        self._mark_failing(device, "failed two first tries in a row, then its probe")
        self._listener.health_changed()

    def _mark_failing(self, device: Device, why: str = "") -> None:
        """Takes the device out of service and starts its restart."""
        why = why or f"failed {device.blame} calls whose inputs then succeeded elsewhere"
        log.warning("%s %s: it takes no work and restarts", device.name, why)
        if device.state in HEALTHY:
            self.healthy -= 1
        device.state = DeviceState.FAILING
        self._end_turns(device)
        device.failures.clear()
        device.blame = 0
        device.failed_first_tries = 0
        self.faults["device_failing"] += 1
        self._tasks.start(self._restart(device), name=f"batchserve-restart-{device.name}")

    def poison_found(self, request: QueuedRequest) -> None:
        """A poison input explains the failed calls it was in: they no longer count against
        their devices."""
        for device in self._devices:
            device.failures = [ids for ids in device.failures if _who(request) not in ids]

    async def _restart(self, device: Device) -> None:
        """Loads the device's versions again on a fresh thread and probes it; rejoins when
        the probe answers, else backs off, doubling, and tries again."""
        delay_s = FIRST_RESTART_DELAY_S
        while True:
            device.state = DeviceState.FAILING
            log.warning("restarting %s: loading its models again on a fresh thread", device.name)
            device.thread.stop()
            device.thread = DeviceThread(device.name)
            device.thread.start(asyncio.get_running_loop())
            problem = await self._reload(device)
            if problem is None and await self._probe(device):
                break
            if problem is not None:
                log.warning("%s failed to restart: %s", device.name, problem)
            self.faults["restart_failed"] += 1
            log.warning("%s stays out; next restart in %.1f s", device.name, delay_s)
            await sleep_until(self._clock, self._clock.time() + delay_s)
            delay_s = min(2 * delay_s, MAX_PROBE_DELAY_S)
        self._rejoin(device, "device_restarted", "restarted and answered its probe")

    async def _reload(self, device: Device) -> str | None:
        """Calls each loaded version's factory again on the device's thread; what failed."""
        for version in list(device.fns):
            try:
                device.fns[version] = await device.thread.submit(version.factory, device.name)
            except Exception as exc:
                return f"{version.spec.label}: {type(exc).__name__}: {exc}"
        return None

    def _failed(
        self, batch: list[QueuedRequest], key: Key, failure: BatchFailure, then: str = ""
    ) -> None:
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
        self._listener.batch_failed(batch, key, failure)

    def _hung(
        self, device: Device, batch: list[QueuedRequest], batch_id: int, budget_s: float
    ) -> None:
        key = device.key
        assert key is not None
        device.state = DeviceState.HUNG
        self._end_turns(device)
        device.busy_since = None
        device.key = None
        device.batch = []
        self.healthy -= 1
        error = BackendError(
            f"the batch call on {device.name} ran past its budget of {budget_s * 1e3:.0f} ms"
        )
        self._failed(
            batch,
            key,
            BatchFailure(FailureKind.HUNG, error, device.name, batch_id),
            then="; the device gets no work until a probe answers in time",
        )
        self._listener.health_changed()

    async def _recover(self, device: Device) -> None:
        """After a hung call returns (its results are dropped), probes until one answers."""
        self.faults["late_result_discarded"] += 1
        log.warning("the hung call on %s returned; its results were discarded", device.name)
        device.state = DeviceState.RECOVERING
        delay_s = self._probe_budget_s(device)
        while True:
            await sleep_until(self._clock, self._clock.time() + delay_s)
            if await self._probe(device):
                break
            delay_s = min(2 * delay_s, MAX_PROBE_DELAY_S)
        self._rejoin(device, "device_recovered", "answered its probe in time")

    def _rejoin(self, device: Device, fault: str, how: str) -> None:
        """A device out of service (hung, or failing) takes work again."""
        device.state = DeviceState.IDLE
        self._hand_turn(device)
        self.healthy += 1
        self.faults[fault] += 1
        log.warning("%s %s; it takes work again", device.name, how)
        self._listener.health_changed()

    def _probe_budget_s(self, device: Device) -> float:
        version = next(iter(device.fns))
        return version.call_budget_s(1)

    async def _probe(self, device: Device) -> bool:
        """One input through the first version loaded on the device."""
        budget_s = self._probe_budget_s(device)
        run = functools.partial(_run_checked, next(iter(device.fns.values())), None)
        call = device.thread.submit(run, [PROBE_INPUT])
        if await wait_until(self._clock, call, self._clock.time() + budget_s):
            try:
                call.result()
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


WARM_UP_INPUT = "batchserve warm-up"


class Malformed(Exception):
    """The batch function answered, but not with one JSON value per input."""


def _run_checked(fn: BatchFn, params: Mapping[str, Any] | None, inputs: list[str]) -> list[Any]:
    """On the device's thread: one batch call, and the check of what it returned, so that
    checking large outputs (vectors) costs the event loop nothing."""
    returned = fn(inputs, **params) if params else fn(inputs)
    if not isinstance(returned, list):
        raise Malformed(
            f"the batch function returned {type(returned).__name__}, not a list of outputs"
        )
    if len(returned) != len(inputs):
        raise Malformed(
            f"the batch function returned {len(returned)} outputs for {len(inputs)} inputs"
        )
    if not all(type(item) is str for item in returned):
        try:
            orjson.dumps(returned, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError as exc:
            problem = f"the batch function returned an output that is not JSON: {exc}"
            raise Malformed(problem) from None
    return returned


Who = tuple[str, str, bool]
"""A request among those in flight: ids are per tenant, so the id alone is not enough."""


def _who(request: QueuedRequest) -> Who:
    return (request.tenant, request.request_id, request.part)


def _error_type(returned: list[Any] | Exception) -> str | None:
    """What a call raised, by type only: its message may quote the inputs."""
    return type(returned).__name__ if isinstance(returned, Exception) else None


def _padded(batch: list[QueuedRequest]) -> int:
    """What a padded batch computes over: its size times its longest input."""
    return len(batch) * max(request.tokens for request in batch)
