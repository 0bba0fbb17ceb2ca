"""Device health as a state machine: pure decisions, no I/O, `now` passed in.

A device is in service (idle, busy, or suspect) or out of it (hung, recovering, failing,
dead). The pool tells `Health` what happened (a call failed or succeeded, a call ran past
its budget, a probe answered) and does what it answers (start a probe, start a restart,
wake the batcher); the threads, calls, timers and logs are the pool's (`gpu_pool.py`).

    IDLE <-> BUSY                 a batch, or a call of the pool's own (the pool's moves)
    IDLE -> SUSPECT -> IDLE       two failed first tries in a row, none elsewhere; its probe
                                  answered: two poison inputs were to blame
    SUSPECT -> FAILING            its probe failed too
    IDLE -> FAILING               `FAILING_BLAME` failed calls whose inputs then succeeded
                                  elsewhere: restarts, backing off, until a probe answers
    BUSY -> HUNG -> RECOVERING    a call past its budget; it returned: probes, backing off
    FAILING, RECOVERING -> IDLE   rejoins once a probe answers in time
    DEAD                          nothing loaded on it at start-up
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field


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
FAILING_BLAME = 2
"""A device is failing once this many of its failed calls (since its last success) had
every input succeed on another device: the device, not an input, was to blame. A poison
input never succeeds anywhere, so poison alone never marks a device failing."""
MAX_FAILURES_KEPT = 64
FIRST_RESTART_DELAY_S = 1.0
"""A device that fails to restart waits this long before the next try, then doubles."""
MAX_PROBE_DELAY_S = 30.0
"""Probes start one budget after the hung call returns and back off, doubling, to this."""

Who = tuple[str, str, bool]
"""A request among those in flight (tenant, id, part): ids are per tenant, so the id alone
is not enough."""


class Verdict(enum.Enum):
    """What a failed call says of its device."""

    INPUTS = "inputs"
    """Nothing against the device yet: an input may be to blame, and the batch is rescued."""
    SUSPECT = "suspect"
    """It is suspect now: the pool probes it."""
    FAILING = "failing"
    """It is to blame: the pool takes it out (`Health.mark_failing`) and restarts it."""


@dataclass(eq=False, kw_only=True)
class DeviceHealth:
    """One device's state and the counts that move it."""

    state: DeviceState = DeviceState.IDLE
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


class Health:
    """The transitions of a pool's devices, and how many are in service."""

    def __init__(self) -> None:
        self.healthy = 0
        """Devices in service (`HEALTHY`)."""
        self._failed_first_tries = 0
        """First tries failed on any device: a suspect's streak must be its own."""

    def __repr__(self) -> str:
        return f"<Health healthy={self.healthy} failed_first_tries={self._failed_first_tries}>"

    def count(self, devices: Iterable[DeviceHealth]) -> None:
        """Counts the devices in service (once they have loaded)."""
        self.healthy = sum(device.state in HEALTHY for device in devices)

    def dead(self, device: DeviceHealth) -> None:
        """Nothing loaded on it: it never serves (before `count`)."""
        device.state = DeviceState.DEAD

    def call_succeeded(self, device: DeviceHealth) -> None:
        """Its streaks end: what failed on it before counts no more."""
        device.failures.clear()
        device.blame = 0
        device.failed_first_tries = 0

    def call_failed(self, device: DeviceHealth, who: set[Who], *, first_try: bool) -> Verdict:
        """A call of the requests `who` raised or answered malformed on `device`; a
        `first_try` held none that had failed before. Two first tries in a row failed here
        and none anywhere else meanwhile: more likely this device than two poison inputs
        (under a flood of poison, all devices fail), so it turns suspect."""
        if first_try:
            if not device.failed_first_tries:
                device.streak_from = self._failed_first_tries
            device.failed_first_tries += 1
            self._failed_first_tries += 1
        suspect = (
            device.failed_first_tries >= 2
            and self._failed_first_tries - device.streak_from == device.failed_first_tries
        )
        device.failures.append(who)
        del device.failures[:-MAX_FAILURES_KEPT]
        if device.blame >= FAILING_BLAME:
            return Verdict.FAILING
        if suspect:
            # A broken device fails fast, so it is the free one most often: left in service
            # it would sink a fresh batch every few milliseconds until blame accrues.
            device.state = DeviceState.SUSPECT
            return Verdict.SUSPECT
        return Verdict.INPUTS

    def exonerate(self, device: DeviceHealth, answered: set[Who]) -> bool:
        """The requests `answered` succeeded elsewhere after failing on `device`: a failed
        call none of whose inputs is left unanswered was the device's fault. True if it is
        to blame and idle now: the pool takes it out (`mark_failing`)."""
        for failed in device.failures:
            failed -= answered
        device.blame += sum(not failed for failed in device.failures)
        device.failures = [failed for failed in device.failures if failed]
        return device.blame >= FAILING_BLAME and device.state is DeviceState.IDLE

    def poison_found(self, devices: Iterable[DeviceHealth], who: Who) -> None:
        """A poison input explains the failed calls it was in: they no longer count against
        their devices."""
        for device in devices:
            device.failures = [ids for ids in device.failures if who not in ids]

    def mark_failing(self, device: DeviceHealth) -> int:
        """Takes the device out of service to restart; returns the blame it had."""
        blame = device.blame
        if device.state in HEALTHY:
            self.healthy -= 1
        device.state = DeviceState.FAILING
        device.failures.clear()
        device.blame = 0
        device.failed_first_tries = 0
        return blame

    def cleared(self, device: DeviceHealth) -> None:
        """A suspect answered its probe: two poison inputs were to blame, not the device."""
        device.state = DeviceState.IDLE
        device.failed_first_tries = 0

    def hung(self, device: DeviceHealth) -> None:
        """A call ran past its budget: out of service until a probe answers in time."""
        device.state = DeviceState.HUNG
        self.healthy -= 1

    def hung_call_returned(self, device: DeviceHealth) -> None:
        device.state = DeviceState.RECOVERING

    def probe_hung(self, device: DeviceHealth) -> None:
        """A probe ran past its budget: no other call until it returns."""
        device.state = DeviceState.HUNG

    def probe_returned(self, device: DeviceHealth) -> None:
        """The probe that hung returned (too late): what follows is its caller's."""
        device.state = DeviceState.RECOVERING

    def suspect_failed_probe(self, device: DeviceHealth) -> None:
        """A suspect failed its probe (one that hung left it recovering): it is still in
        service until `mark_failing` takes it out."""
        device.state = DeviceState.SUSPECT

    def restarting(self, device: DeviceHealth) -> None:
        """A restart (another try) begins: out of service until its probe answers."""
        device.state = DeviceState.FAILING

    def rejoin(self, device: DeviceHealth) -> None:
        """A device out of service (hung, or failing) takes work again."""
        device.state = DeviceState.IDLE
        self.healthy += 1


class Backoff:
    """The times of retries that back off, doubling from `first_s` to `max_s`."""

    __slots__ = ("_delay_s", "_max_s")

    def __init__(self, first_s: float, max_s: float = MAX_PROBE_DELAY_S) -> None:
        self._delay_s = first_s
        self._max_s = max_s

    def __repr__(self) -> str:
        return f"<Backoff next in {self._delay_s:.1f} s>"

    def next_at(self, now: float) -> float:
        """When the next try is due, counted from `now`; the one after waits twice as long."""
        due = now + self._delay_s
        self._delay_s = min(2 * self._delay_s, self._max_s)
        return due
