"""The care of devices out of service: probing a suspect, restarting a failing device
(backing off while that fails), and probing a device whose hung call returned, until each
answers in time and rejoins. A device's batch versions and its residents (generators) are
loaded again and probed alike. `Devices` (fleet.py) owns one `Care` and the tasks it starts;
what each state means is `health.py`'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Callable, Coroutine

from ..batching.faults import PROBE_INPUT
from ..clock import Clock, sleep_until, wait_until
from ..tasks import TaskSet
from .device import Device, Probe, run_checked
from .health import FIRST_RESTART_DELAY_S, Backoff, Health
from .loading import reload
from .thread import DeviceThread

log = logging.getLogger(__name__)


class Care:
    """Probes and restarts; tells `changed` when a device goes out of service or back."""

    def __init__(
        self,
        health: Health,
        *,
        clock: Clock,
        faults: Counter[str],
        tasks: TaskSet,
        changed: Callable[[Device], None],
    ) -> None:
        self._health = health
        self._clock = clock
        self.faults = faults
        """The devices' fault counts (shared: counted in the logs and on /metrics)."""
        self._tasks = tasks
        """The devices' tasks: their owner cancels them on close."""
        self._changed = changed

    def __repr__(self) -> str:
        return f"<Care {self._health!r}>"

    async def check(self, device: Device) -> None:
        """Probes a suspect device: one that fails a known-good input is broken and
        restarts; one that answers had two poison inputs in a row, and takes work again."""
        if await self._probe(device):
            self._health.cleared(device)
            device.hand_turn()
            self.faults["device_cleared"] += 1
            log.warning("%s answered its probe after two failed first tries; it takes work again",
                        device.name)  # fmt: skip
            self._changed(device)
            return
        self._health.suspect_failed_probe(device)
        self.mark_failing(device, "failed two first tries in a row, then its probe")
        self._changed(device)

    def mark_failing(self, device: Device, why: str = "") -> None:
        """Takes the device out of service and starts its restart."""
        blame = self._health.mark_failing(device)
        why = why or f"failed {blame} calls whose inputs then succeeded elsewhere"
        log.warning("%s %s: it takes no work and restarts", device.name, why)
        device.end_turns()
        self.faults["device_failing"] += 1
        self._tasks.start(self._restart(device), name=f"batchserve-restart-{device.name}")

    async def _restart(self, device: Device) -> None:
        """Loads the device's versions and residents again on a fresh thread and probes it;
        rejoins when the probe answers, else backs off, doubling, and tries again."""
        backoff = Backoff(FIRST_RESTART_DELAY_S)
        while True:
            self._health.restarting(device)
            log.warning("restarting %s: loading its models again on a fresh thread", device.name)
            device.thread.stop()
            device.thread = DeviceThread(device.name)
            device.thread.start(asyncio.get_running_loop())
            problem = await reload(device) or await _reload_residents(device)
            if problem is None and await self._probe(device):
                break
            if problem is not None:
                log.warning("%s failed to restart: %s", device.name, problem)
            self.faults["restart_failed"] += 1
            now = self._clock.time()
            due = backoff.next_at(now)
            log.warning("%s stays out; next restart in %.1f s", device.name, due - now)
            await sleep_until(self._clock, due)
        self._rejoin(device, "device_restarted", "restarted and answered its probe")

    def returned_late(self, device: Device) -> Coroutine[object, object, None]:
        """A hung call returned: its results are dropped, and probes follow, backing off
        from one probe budget from now (timed here, not when the task first runs), until
        one answers in time; the coroutine that runs them."""
        self.faults["late_result_discarded"] += 1
        log.warning("the hung call on %s returned; its results were discarded", device.name)
        self._health.hung_call_returned(device)
        backoff = Backoff(self._probe_budget_s(device))
        return self._recover(device, backoff, backoff.next_at(self._clock.time()))

    async def _recover(self, device: Device, backoff: Backoff, due: float) -> None:
        while True:
            await sleep_until(self._clock, due)
            if await self._probe(device):
                break
            due = backoff.next_at(self._clock.time())
        self._rejoin(device, "device_recovered", "answered its probe in time")

    def _rejoin(self, device: Device, fault: str, how: str) -> None:
        """A device out of service (hung, or failing) takes work again."""
        self._health.rejoin(device)
        device.hand_turn()
        self.faults[fault] += 1
        log.warning("%s %s; it takes work again", device.name, how)
        self._changed(device)

    def _probe_budget_s(self, device: Device) -> float:
        return _probe_of(device)[2]

    async def _probe(self, device: Device) -> bool:
        """One known-good call: an input through the first version loaded on the device,
        else through its first resident."""
        run, arg, budget_s = _probe_of(device)
        call = device.thread.submit(run, arg)
        if await wait_until(self._clock, call, self._clock.time() + budget_s):
            try:
                call.result()
                return True
            except Exception as exc:
                problem = f"failed: {type(exc).__name__}: {exc}"
        else:
            problem = f"ran past {budget_s * 1e3:.0f} ms"
            self._health.probe_hung(device)
            await asyncio.wait((call,))  # never a second call while one is inside
            self._health.probe_returned(device)
        self.faults["probe_failed"] += 1
        log.warning("the probe of %s %s", device.name, problem)
        return False


def _probe_of(device: Device) -> Probe:
    if device.fns:
        version, fn = next(iter(device.fns.items()))
        return functools.partial(run_checked, fn, None), [PROBE_INPUT], version.call_budget_s(1)
    return device.residents[0].probe()


async def _reload_residents(device: Device) -> str | None:
    """Loads each resident again on the device's thread; what failed."""
    for resident in device.residents:
        try:
            await resident.reload()
        except Exception as exc:
            return f"{resident!r}: {type(exc).__name__}: {exc}"
    return None
