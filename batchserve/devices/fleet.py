"""Every physical device of an engine, by name, each one runner whoever calls it: the pool's
batch calls and the step loops' steps both go through a device's one thread, one call at a
time, under one watchdog, and what happens to them moves one health machine (`health.py`)
whose verdicts this module carries out: a probe for a suspect, a restart for a failing
device, probes after a hung call returns (`care.py`). So a device shared by a batch model and
a generation model runs a batch or a step, never both, and a generation device gets the
health states, probes and restarts a batch device has.

The watchdog judges a device by its thread, not by when the loop got round to looking: when
a call's budget is up it is not hung if its thread has already returned the call (the loop
was stalled: tokenizing, a slow handler), nor if the caller's `progress` counter (a
generator's, bumped once a layer) moved in the last budget: a busy machine's slow step gets
another budget, as many as it keeps advancing. Only a call that made no progress for a whole
budget is hung.

The pool keeps its fast path: it takes an idle device, submits and arms the watchdog
(`watch`) without a coroutine of its own in between. A step takes its turn (`call`): after a
batch, a waiting step goes first; after a step on a device with batch versions, the batcher
(woken) may take the device first, so the two alternate under load.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ..clock import Clock
from ..tasks import CrashHandler, TaskSet
from .care import Care
from .device import Device
from .health import HEALTHY, DeviceState, Health, Verdict, Who
from .thread import DeviceThread

Arg = TypeVar("Arg")
Ret = TypeVar("Ret")

OnHung = Callable[[float], None]
"""Told, with the budget it ran past, that the call hung: its work goes elsewhere."""
Progress = Callable[[], int | None]
"""A call's work counter, if it keeps one: a call that still advances is not hung."""


@dataclass(frozen=True, slots=True)
class DeviceStats:
    name: str
    state: DeviceState
    busy_ratio: float
    """Share of the last BUSY_WINDOW_S spent inside calls (batches and steps)."""
    busy_seconds: float
    """Time spent in finished calls."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    """What the metrics and the dashboard read of the devices at a scrape (copies)."""

    devices: tuple[DeviceStats, ...]
    faults: Mapping[str, int]

    @classmethod
    def of(cls, devices: Iterable[Device], faults: Mapping[str, int], now: float) -> PoolStats:
        return cls(
            tuple(DeviceStats(d.name, d.state, d.busy_ratio(now), d.busy_total_s) for d in devices),
            dict(faults),
        )


class OutOfService(Exception):
    """The device left service: its call hung (its `OnHung` was told; `ran`), or it was
    out before the call could take it."""

    def __init__(self, message: str, *, ran: bool) -> None:
        super().__init__(message)
        self.ran = ran


class Devices:
    """The devices by name, one health machine and one care for all of them; the tasks of
    their probes and restarts, and their threads, which closing ends."""

    def __init__(
        self, *, clock: Clock, on_crash: CrashHandler, changed: Callable[[Device], None]
    ) -> None:
        """`changed` hears of every device that leaves service, comes back, frees, or is
        taken by a call that is not the batcher's (the pool, which tells the batcher)."""
        self._clock = clock
        self._by_name: dict[str, Device] = {}
        self._changed = changed
        self._tasks = TaskSet(on_crash)
        self.health = Health()
        self.faults: Counter[str] = Counter()
        """Faults by kind, counted in the logs and on /metrics."""
        self._care = Care(
            self.health, clock=clock, faults=self.faults, tasks=self._tasks, changed=self.changed
        )

    def __repr__(self) -> str:
        return f"<Devices {list(self._by_name)} {self.health!r}>"

    def get(self, name: str) -> Device:
        """The device called `name`, the same object for every model placed on it."""
        device = self._by_name.get(name)
        if device is None:
            device = self._by_name[name] = Device(name, DeviceThread(name))
        return device

    def open(self, device: Device) -> None:
        """Starts the device's thread, once, whoever uses it first."""
        if not device.thread.started:
            device.thread.start(asyncio.get_running_loop())
            self.health.count(self._by_name.values())

    async def __aenter__(self) -> Devices:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Cancels probes and restarts, then ends every thread after what it runs, waiting
        up to each device's `stop_wait_s` (a process that exits under a thread inside torch
        aborts)."""
        await self._tasks.aclose()
        for device in self._by_name.values():
            device.thread.stop()
        await asyncio.gather(
            *(d.thread.join(d.stop_wait_s) for d in self._by_name.values() if d.stop_wait_s)
        )

    def changed(self, device: Device) -> None:
        device.in_service_again()
        self._changed(device)

    # Calls

    def watch(
        self,
        device: Device,
        fn: Callable[[Arg], Ret],
        arg: Arg,
        budget_s: float,
        on_hung: OnHung,
        progress: Progress | None = None,
    ) -> asyncio.Future[Ret]:
        """`fn(arg)` on the device (taken: BUSY) under its watchdog; the caller awaits the
        future, then calls `returned`."""
        call = device.thread.submit(fn, arg)
        self.arm(device, device.thread.submitted, budget_s, on_hung, progress)
        return call

    def arm(
        self,
        device: Device,
        call: int,
        budget_s: float,
        on_hung: OnHung,
        progress: Progress | None = None,
    ) -> None:
        """The watchdog of call number `call` on the device (one the thread started of
        itself, prepared: `DeviceThread.prepare`), its budget counted from now."""
        seen = None if progress is None else progress()
        device.watchdog = self._clock.call_at(
            self._clock.time() + budget_s,
            self._look,
            device,
            call,
            seen,
            budget_s,
            on_hung,
            progress,
        )

    def returned(self, device: Device) -> bool:
        """The watched call came back; True if it had hung: its results are dropped and
        probes run until one answers in time."""
        if device.watchdog is not None:
            device.watchdog.cancel()
            device.watchdog = None
        if device.state is not DeviceState.HUNG:
            return False
        recovery = self._care.returned_late(device)
        self._tasks.start(recovery, name=f"batchserve-recover-{device.name}")
        return True

    def release(self, device: Device) -> None:
        """A call that is not the batcher's ended: the device goes to the next turn, or is
        free (and the batcher hears of it)."""
        if device.state is DeviceState.BUSY and not device.hand_turn():
            device.state = DeviceState.IDLE
            if device.fns:
                self.changed(device)

    async def call(
        self,
        device: Device,
        fn: Callable[[Arg], Ret],
        arg: Arg,
        budget_s: float,
        on_hung: OnHung,
        *,
        progress: Progress | None = None,
        who: set[Who] | None = None,
        first_try: bool = False,
    ) -> tuple[Ret, float]:
        """`fn(arg)` in the device's turn, under its watchdog: what it returned, and its
        seconds inside. Raises OutOfService if the device is out or its call hangs; else
        what `fn` raised. A call of `who` (requests, or sequences) is judged by the health
        machine, failed or succeeded; one without is not."""
        if not await device.take_turn():
            raise OutOfService(f"{device.name} is {device.state.value}", ran=False)
        if device.fns:  # the batcher counts free devices: one taken is no longer free
            self.changed(device)
        device.busy_since = started = self._clock.time()
        done = self.watch(device, fn, arg, budget_s, on_hung, progress)
        try:
            returned: Ret | Exception = await done
        except Exception as exc:
            returned = exc
        if self.returned(device):
            raise OutOfService(f"the hung call on {device.name} returned", ran=True)
        device.busy_since = None
        finished = self._clock.time()
        device.call_ended(started, finished)
        if not isinstance(returned, Exception):
            if who is not None:  # a release is not judged: it says little of the device
                self.health.call_succeeded(device)
            self.release(device)
            return returned, finished - started
        if who is not None:  # judged before anyone else takes the device
            device.state = DeviceState.IDLE
            if self.failed(device, who, first_try=first_try) is Verdict.FAILING:
                self.changed(device)
            if device.state is DeviceState.IDLE:
                device.state = DeviceState.BUSY  # released below
        self.release(device)
        raise returned

    def _look(
        self,
        device: Device,
        call: int,
        seen: int | None,
        budget_s: float,
        on_hung: OnHung,
        progress: Progress | None,
    ) -> None:
        """The budget of call number `call` is up: hung only if its thread has not returned
        it (else the loop was late to hear) and it made no progress since the last look."""
        if device.thread.returned >= call:
            return
        now = None if progress is None else progress()
        if now != seen:  # slow, still advancing: another budget
            device.watchdog = self._clock.call_at(
                self._clock.time() + budget_s,
                self._look,
                device,
                call,
                now,
                budget_s,
                on_hung,
                progress,
            )
            return
        if not device.thread.stalled(call):
            return  # it returned just now
        self.health.hung(device)
        device.end_turns()
        device.busy_since = None
        on_hung(budget_s)
        self.changed(device)

    # The health machine's verdicts, carried out

    def failed(self, device: Device, who: set[Who], *, first_try: bool) -> Verdict:
        """A call of `who` on the (idle) device failed: probes it if suspect now; takes it
        out and restarts it if failing, which the caller announces (`changed`) once it has
        handed the call's work on."""
        verdict = self.health.call_failed(device, who, first_try=first_try)
        if verdict is Verdict.SUSPECT:
            self._tasks.start(self._care.check(device), name=f"batchserve-check-{device.name}")
        elif verdict is Verdict.FAILING:
            self._care.mark_failing(device)
        return verdict

    def exonerate(self, names: set[str], answered: set[Who]) -> None:
        """Requests `answered` succeeded after failing on the devices `names`: a device to
        blame is taken out and restarts."""
        for name in names:
            device = self._by_name[name]
            if self.health.exonerate(device, answered):
                self._care.mark_failing(device)
                self.changed(device)

    def poison_found(self, who: Who) -> None:
        """A poison input explains the failed calls it was in."""
        self.health.poison_found(self._by_name.values(), who)

    def dead(self, device: Device) -> None:
        """Nothing loaded on it: it never serves."""
        if device.state in HEALTHY:
            self.health.dead(device)
            self.health.count(self._by_name.values())
            self.faults["device_dead"] += 1
