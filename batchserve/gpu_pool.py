"""The batch models' side of the devices: each device runs one call at a time, a batch or
(on a device shared with a generation model) a step.

The pool loads each device's batch function on that device's thread (so weights land where
they will be used), runs batches there under the device's watchdog, checks what comes back
and resolves the waiting futures on the event loop. A failed batch goes back to the batcher
(which builds the pool, handing it its callbacks), which decides what runs again. The
devices themselves, their threads, their watchdog, the health machine and the care of
devices out of service (probes, restarts) are `devices/`'s (`Devices`, fleet.py), shared
with the generation models' step loops. The pool owns every task it starts and cancels
what is left of them on close. Each successful call's duration goes into the engine's one
batch-time estimate; all timing reads its clock. An idle call (the Batch API's) may have the
next prepared behind it (`prepared`, `devices/prepared.py`): the device's thread starts it
as the call returns, and the pool takes it up as its own when it handles that call's end.

GpuPool has about 27 methods, 10 of them short queries the batcher asks of the devices at
each decision (free_for, healthy_for, ...), which belong with the devices they count.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from typing import Any

from .batching.faults import BatchFailure, FailureKind
from .batching.request import QueuedRequest, Result
from .clock import Clock
from .devices import loading
from .devices.calls import BatchCall, error_type
from .devices.device import Device, Malformed, padded, run_checked, who
from .devices.fleet import Devices, PoolStats
from .devices.health import HEALTHY, DeviceState, Verdict
from .devices.prepared import PreparedCall, PreparedCalls, Withdrawn
from .errors import BackendError, BatchserveError, StartupError
from .models.registry import Key, ModelVersion
from .models.specs import DEFAULT_MODEL
from .tasks import CrashHandler, TaskSet

log = logging.getLogger(__name__)


BatchDone = Callable[[list[QueuedRequest], float, float], None]
"""A batch's call, from `started`, succeeded at `finished` and its device is free; told
before anyone is answered."""
BatchFailed = Callable[[list[QueuedRequest], Key, BatchFailure], None]
"""Nobody in the batch (all of the key) has been answered: who hears retries or fails them."""
IdleStarted = Callable[[Key, list[QueuedRequest]], int]
"""A prepared idle call started (`devices/prepared.py`): its batch id, counted as sent."""


LOGGED_IDS = 5
"""A failed batch's log line names this many request ids and counts the rest."""


class GpuPool:
    """The physical devices, shared by every model version placed on them."""

    def __init__(
        self,
        versions: list[ModelVersion],
        *,
        clock: Clock,
        on_crash: CrashHandler,
        batch_done: BatchDone,
        batch_failed: BatchFailed,
        health_changed: Callable[[], None],
        idle_started: IdleStarted,
        idle_withdrawn: Withdrawn,
        on_call: Callable[[BatchCall], None] | None = None,
        devices: Devices | None = None,
    ) -> None:
        """Who hears what happens (the batcher, which builds its pool): `batch_done`,
        `batch_failed`, and `health_changed` when a device goes out of service or comes
        back; `idle_started` and `idle_withdrawn` of its prepared idle calls; `on_call`
        of each batch call as it returns, before anyone is answered (tracing). `devices`:
        the engine's, shared with its generation models and built before the pool (the
        engine forwards their `changed` to `device_changed`); without them the pool has
        devices of its own, which tell it directly and which it closes."""
        self._versions = versions
        self._clock = clock
        self._batch_done = batch_done
        self._batch_failed = batch_failed
        self._health_changed = health_changed
        self._on_call = on_call
        self._idle_started = idle_started
        self.prepared = PreparedCalls(idle_withdrawn)
        """Idle calls prepared to follow the one in hand (`prepare`)."""
        self._own = devices is None
        self._fleet = devices or Devices(
            clock=clock, on_crash=on_crash, changed=self.device_changed
        )
        names = dict.fromkeys(name for v in versions for name in v.device_names)
        self.devices = [self._fleet.get(name) for name in names]
        """Its devices (not to be changed: the batcher counts them at every decision)."""
        self._names = frozenset(names)
        self._tasks = TaskSet(on_crash)
        self._sharing: dict[ModelVersion, frozenset[ModelVersion]] = {}
        """`sharing`'s answers, until a load or unload changes what the devices hold."""
        self._all_shared: bool | None = None
        """`all_shared`'s answer, until a load or unload changes what the devices hold."""
        self.faults: Counter[str] = self._fleet.faults
        """Faults by kind, the devices' (shared), counted in the logs and on /metrics."""
        self.healthy = 0
        """Its devices in service, counted again whenever one changes."""

    def __repr__(self) -> str:
        return (
            f"<GpuPool devices={len(self.devices)} healthy={self.healthy} free={self.free_count}>"
        )

    @property
    def free_count(self) -> int:
        # Counted in a list, not summed over a generator: the batcher asks at every arrival.
        return [device.state for device in self.devices].count(DeviceState.IDLE)

    def free_only_for(self, versions: set[ModelVersion]) -> bool:
        """Whether a free device holds only `versions` (the batcher's: those idle lines may
        not use while online requests wait)."""
        return any(
            d.state is DeviceState.IDLE and d.fns and d.fns.keys() <= versions for d in self.devices
        )

    def free_for(self, version: ModelVersion, avoid: tuple[str, ...] = ()) -> int:
        """Free devices that can run `version`, other than those named in `avoid`."""
        if not avoid:  # the batcher's question at every decision
            return sum(d.state is DeviceState.IDLE and version in d.fns for d in self.devices)
        return sum(
            d.state is DeviceState.IDLE and version in d.fns and d.name not in avoid
            for d in self.devices
        )

    def healthy_for(self, version: ModelVersion, avoid: tuple[str, ...] = ()) -> int:
        return sum(
            d.state in HEALTHY and version in d.fns and d.name not in avoid for d in self.devices
        )

    def healthy_versions(self) -> Iterator[Collection[ModelVersion]]:
        """The versions on each device in service."""
        return (device.fns.keys() for device in self.devices if device.state in HEALTHY)

    @property
    def all_shared(self) -> bool:
        """Whether every version shares a device with every other (one device, one model,
        or all on all): then a request waiting for any of them bars idle lines from all."""
        if self._all_shared is None:
            every = frozenset(v for d in self.devices for v in d.fns)
            self._all_shared = all(self.sharing(v) == every for v in every)
        return self._all_shared

    def sharing(self, version: ModelVersion) -> frozenset[ModelVersion]:
        """The versions loaded on any device `version` is on, itself included."""
        neighbours = self._sharing.get(version)
        if neighbours is None:
            neighbours = self._sharing[version] = frozenset(
                v for d in self.devices if version in d.fns for v in d.fns
            )
        return neighbours

    def busy_since_of(self, key: Key) -> list[float]:
        """Start times of the batches of `key` running now: what its spacing counts from."""
        return [
            d.busy_since
            for d in self.devices
            if d.busy_since is not None and (d.key is key or d.key == key)
        ]

    @property
    def in_flight_requests(self) -> int:
        """Requests running and still unanswered (a deadline may have answered one)."""
        return sum(not r.future.done() for device in self.devices for r in device.batch)

    def stats(self, now: float) -> PoolStats:
        return PoolStats.of(self.devices, self.faults, now)

    def states(self) -> dict[str, str]:
        return {device.name: device.state.value for device in self.devices}

    async def __aenter__(self) -> GpuPool:
        """Loads every version on each of its devices (on that device's thread, so weights
        land where they run); a device where nothing loaded is dead."""
        for device in self.devices:
            self._fleet.open(device)
        problems: list[str] = []
        for version in self._versions:
            problems += await self.load(version)
        for device in self.devices:
            if not device.fns:
                self._fleet.dead(device)
        self.device_changed(None)
        unloaded = [v.spec.label for v in self._versions if not v.loaded_on]
        if unloaded:
            if self._own:
                await self._fleet.__aexit__()
            if [v.name for v in self._versions] == [DEFAULT_MODEL]:
                raise StartupError("no device loaded: " + "; ".join(problems))
            raise StartupError(f"{', '.join(unloaded)} loaded on no device: " + "; ".join(problems))
        for problem in problems:
            log.error("%s; serving on the other devices", problem)
        return self

    async def load(self, version: ModelVersion, *, beside_serving: bool = False) -> list[str]:
        """Loads `version` on its devices in service (see `devices/loading.py`); returns
        what failed."""
        devices = [d for d in self.devices if d.name in version.device_names and d.state in HEALTHY]
        problems = await loading.load(
            devices, version, beside_serving=beside_serving, changed=self._fleet.changed
        )
        self._placement_changed()
        return problems

    def device_changed(self, device: Device | None) -> None:
        """One of the devices left service, came back, freed or was taken by a call not the
        batcher's (None: any, at start)."""
        if device is None or device.name in self._names:
            self.healthy = sum(d.state in HEALTHY for d in self.devices)
            if device is not None:
                self._health_changed()

    def unload(self, version: ModelVersion) -> None:
        """Drops `version`'s batch functions, so that its weights can be freed; the caller
        has made sure none of its batches runs."""
        loading.unload(self.devices, version)
        self._placement_changed()

    def _placement_changed(self) -> None:
        """What the devices hold changed: the answers cached from it are forgotten."""
        self._sharing.clear()
        self._all_shared = None

    def running(self, version: ModelVersion) -> bool:
        """Whether a batch of `version` is inside a device now."""
        return any(d.key is not None and d.key.version is version for d in self.devices)

    async def __aexit__(self, *exc_info: object) -> None:
        """Cancels what is left: calls nobody waits for after the drain; then its own
        devices' probes and threads; what is prepared never starts."""
        self.prepared.withdraw()
        await self._tasks.aclose()
        if self._own:
            await self._fleet.__aexit__()

    def dispatch(
        self, batch: list[QueuedRequest], batch_id: int, key: Key, reason: str = "policy"
    ) -> None:
        """Starts `batch` (every request of `key`) on a free device that runs its version;
        the caller has checked that one is free. `reason`: why it left, for `on_call`."""
        version = key.version
        device = next(d for d in self.devices if d.state is DeviceState.IDLE and version in d.fns)
        avoid = batch[-1].failed_on  # riding rescue groups, if any, come last
        if device.name in avoid:  # a rescue: another device, if one is free
            device = next(
                (
                    d
                    for d in self.devices
                    if d.state is DeviceState.IDLE and version in d.fns and d.name not in avoid
                ),
                device,
            )
        device.state = DeviceState.BUSY
        # Submitted here, not in the task's first step: that step would queue behind every
        # handler that the last finished batch just woke, leaving the device idle meanwhile.
        run = functools.partial(run_checked, device.fns[version], key.params)
        call = device.thread.submit(run, [r.input for r in batch])
        number = device.thread.submitted
        self._running(device, batch, batch_id, key, self._clock.time(), (call, number), reason)

    def _running(
        self,
        device: Device,
        batch: list[QueuedRequest],
        batch_id: int,
        key: Key,
        started: float,
        call: tuple[asyncio.Future[list[Any]], int],
        reason: str,
    ) -> None:
        """The call of `batch` is in hand on the (taken) device since `started`: its
        future, and its number on the thread (the watchdog's)."""
        device.busy_since = started
        device.key = key
        device.batch = batch
        for request in batch:
            request.running = True
        # The watchdog is a plain timer, not asyncio.wait: that would add a loop pass between
        # the call's end and this device's next batch, and under load each pass waits behind
        # every handler.
        future, number = call
        self._fleet.arm(
            device,
            number,
            key.version.call_budget_s(padded(batch)),
            functools.partial(self._hung, device, batch, batch_id),
        )
        self._tasks.start(
            self._finish(device, batch, batch_id, started, future, reason),
            name=f"batchserve-batch-{batch_id}",
        )

    def _follow(self, device: Device, prepared: PreparedCall, started: float) -> None:
        """The thread started `prepared` as the call before it returned, at `started` as
        the loop counts (a device's calls stay back to back)."""
        batch_id = self._idle_started(prepared.key, prepared.batch)
        call = (prepared.next.future, prepared.next.number)
        self._running(device, prepared.batch, batch_id, prepared.key, started, call, "idle")

    def fail_in_flight(self, error: BatchserveError) -> None:
        """Answers everyone whose batch is still running, or prepared to; late results are
        then dropped."""
        running = itertools.chain(*(device.batch for device in self.devices))
        for request in itertools.chain(running, self.prepared.requests()):
            if not request.future.done():
                request.future.set_exception(error)

    async def _finish(
        self,
        device: Device,
        batch: list[QueuedRequest],
        batch_id: int,
        started: float,
        call: asyncio.Future[list[Any]],
        reason: str,
    ) -> None:
        try:
            returned: list[Any] | Exception = await call
        except Exception as exc:
            returned = exc
        hung = self._fleet.returned(device)  # then the watchdog handed the batch back
        if self._on_call is not None:
            error = "hung" if hung else error_type(returned)
            now = self._clock.time()
            self._on_call(BatchCall(batch, batch_id, device.name, started, now, reason, error))
        if hung:
            return
        key = device.key
        assert key is not None
        finished = self._clock.time()
        following = self.prepared.after(device)  # only after a call that succeeded
        if following is None:
            device.state = DeviceState.IDLE
            device.busy_since = None
            device.key = None
            device.batch = []
        else:
            self._follow(device, following, finished)
        device.call_ended(started, finished)
        key.version.device_time.add(finished, finished - started)
        if isinstance(returned, Exception):
            self._call_failed(device, batch, key, batch_id, returned)
            if device.state is DeviceState.IDLE:
                device.hand_turn()
            return
        self._fleet.health.call_succeeded(device)
        if batch[0].failed_on:  # a rescue: where it failed before may have been to blame
            names = {name for r in batch for name in r.failed_on} - {device.name}
            self._fleet.exonerate(names, {who(r) for r in batch})
        outputs = returned
        version = key.version
        version.estimate.observe(finished - started, padded(batch))
        if following is None:
            device.hand_turn()
        # Wake the batcher before the waiting handlers: its wake-up is then queued ahead of
        # theirs, so the device gets its next batch before a hundred responses are written.
        self._batch_done(batch, started, finished)
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
        first_try = not any(request.failed_on for request in batch)
        for request in batch:
            request.failed_on += (device.name,)
        verdict = self._fleet.failed(device, {who(r) for r in batch}, first_try=first_try)
        if verdict is Verdict.SUSPECT:
            self._failed(
                batch,
                key,
                BatchFailure(FailureKind.SUSPECT_DEVICE, error, device.name, batch_id, shared),
                then=f"; {device.name} failed its last first try too, and is probed",
            )
            return
        if verdict is Verdict.INPUTS:
            self._failed(batch, key, BatchFailure(kind, error, device.name, batch_id, shared))
            return
        self._failed(
            batch,
            key,
            BatchFailure(FailureKind.DEVICE_FAILING, error, device.name, batch_id, shared),
            then=f"; {device.name} is failing and restarts",
        )
        self._fleet.changed(device)

    def poison_found(self, request: QueuedRequest) -> None:
        """A poison input explains the failed calls it was in: they no longer count against
        their devices."""
        self._fleet.poison_found(who(request))

    def _failed(
        self, batch: list[QueuedRequest], key: Key, failure: BatchFailure, then: str = ""
    ) -> None:
        self.faults[f"batch_{failure.kind.value}"] += 1
        for request in batch:
            request.running = False  # handed back: queued again, or answered
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
        self._batch_failed(batch, key, failure)

    def _hung(
        self, device: Device, batch: list[QueuedRequest], batch_id: int, budget_s: float
    ) -> None:
        """The watchdog found the call hung (the device is out): the batch goes back."""
        key = device.key
        assert key is not None
        device.key = None
        device.batch = []
        self.prepared.after(device)  # withdrawn: the thread never starts it (`stalled`)
        error = BackendError(
            f"the batch call on {device.name} ran past its budget of {budget_s * 1e3:.0f} ms"
        )
        self._failed(
            batch,
            key,
            BatchFailure(FailureKind.HUNG, error, device.name, batch_id),
            then="; the device gets no work until a probe answers in time",
        )
