"""A physical device, the one runner of every call made on it: its thread, the batch versions
and the residents (generation models' step loops) loaded on it, the batch it runs, its busy
time, its turns for calls that are not the batcher's (steps, a warm-up), and (inherited) its
health; and the one checked call that every batch, warm-up and probe makes on its thread."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from ..batching.request import QueuedRequest
from ..clock import Timer
from ..models.registry import Key, ModelVersion
from ..models.specs import BatchFn
from .health import HEALTHY, DeviceHealth, DeviceState, Who
from .thread import DeviceThread

BUSY_WINDOW_S = 10.0
"""The busy ratio's window."""

Probe = tuple[Callable[[Any], object], Any, float]
"""A known-good call, its argument and its budget in seconds."""


class Resident(Protocol):
    """What lives on a device beside its batch versions and must come back with it after a
    restart: a generation model's step loop (its generator)."""

    async def reload(self) -> object:
        """Loads again on the device's fresh thread; raises if that fails."""

    def probe(self) -> Probe:
        """A known-good call through it, to tell whether the device answers."""


@dataclass(eq=False)
class Device(DeviceHealth):
    """A device: its thread, what it holds and runs, and (inherited, so that the hot paths
    read `device.state` directly) its health, which `Health` moves. Every call on it, a
    batch or a step, takes it (BUSY) first: one call at a time, whoever makes it."""

    name: str
    thread: DeviceThread
    fns: dict[ModelVersion, BatchFn] = field(default_factory=dict)
    """The batch function of each model version loaded here."""
    busy_since: float | None = None
    key: Key | None = None
    """The compatibility key of the batch running now."""
    batch: list[QueuedRequest] = field(default_factory=list)
    busy_total_s: float = 0.0
    """Time spent in finished batch calls, for the busy ratio."""
    recent_calls: deque[tuple[float, float]] = field(default_factory=deque)
    """(start, end) of the calls that ended in the last BUSY_WINDOW_S (add them by
    `call_ended`)."""
    recent_busy_s: float = 0.0
    """The recent calls' durations summed, kept as calls come and go: the inference
    gateway scrapes 20 times a second, and a walk of the window at each cost more than
    the rest of the device's series."""
    turns: deque[asyncio.Future[bool]] = field(default_factory=deque)
    """Calls that are not the batcher's (steps, a new version's warm-up) waiting for the
    device to be free: each takes it before the batcher can, once the call inside returned."""
    residents: list[Resident] = field(default_factory=list)
    watchdog: Timer | None = None
    """The running call's: it looks at the device when the call's budget is up."""
    stop_wait_s: float = 0.0
    """How long closing waits for a call still inside (a resident's step in torch)."""
    back: list[asyncio.Future[None]] = field(default_factory=list)
    """Who waits for the device to be in service again (`wait_in_service`)."""

    def call_ended(self, started: float, finished: float) -> None:
        """Counts a call in the busy ratio; the window drops what it no longer covers here
        too, not only when the ratio is read (by a scrape that may never come)."""
        self.busy_total_s += finished - started
        self.recent_calls.append((started, finished))
        self.recent_busy_s += finished - started
        self._forget_calls_before(finished - BUSY_WINDOW_S)

    def busy_ratio(self, now: float) -> float:
        """Share of the last BUSY_WINDOW_S spent inside batch calls."""
        since = now - BUSY_WINDOW_S
        self._forget_calls_before(since)
        busy = self.recent_busy_s
        for start, _ in self.recent_calls:
            # A device runs one call at a time, so calls are in order of start too: only
            # the first ones can have started before the window, and count from its start.
            if start >= since:
                break
            busy -= since - start
        if self.busy_since is not None:
            busy += now - max(self.busy_since, since)
        return min(1.0, busy / BUSY_WINDOW_S)

    def _forget_calls_before(self, since: float) -> None:
        calls = self.recent_calls
        while calls and calls[0][1] <= since:
            start, end = calls.popleft()
            self.recent_busy_s -= end - start
        if not calls:
            self.recent_busy_s = 0.0  # no rounding left over from the sums

    async def take_turn(self) -> bool:
        """Takes the device (busy, holding no batch) for a call that is not the batcher's as
        soon as it is free; False if it leaves service first (hung, failing)."""
        if self.state is DeviceState.IDLE and self.fns:
            # Batch versions live here: the batcher, woken when the device freed, is let have
            # it first (one loop pass), so that steps do not run back to back past its batches.
            await asyncio.sleep(0)
        if self.state not in HEALTHY:
            return False
        if self.state is DeviceState.IDLE and all(turn.done() for turn in self.turns):
            self.state = DeviceState.BUSY
            return True
        turn: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.turns.append(turn)
        return await turn

    def hand_turn(self) -> bool:
        """A device just freed goes to the first call of the pool's own that waits for it,
        not to the batcher; True if one took it."""
        while self.turns:
            turn = self.turns.popleft()
            if not turn.done():  # its waiter may have been cancelled
                self.state = DeviceState.BUSY
                turn.set_result(True)
                return True
        return False

    def end_turns(self) -> None:
        """The device left service: what waited for its turn does without it."""
        while self.turns:
            turn = self.turns.popleft()
            if not turn.done():
                turn.set_result(False)

    async def wait_in_service(self) -> None:
        """Returns once the device is in service (`HEALTHY`)."""
        while self.state not in HEALTHY:
            back: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.back.append(back)
            await back

    def in_service_again(self) -> None:
        """Wakes who waits for the device, if it is in service now."""
        if self.state in HEALTHY:
            back, self.back = self.back, []
            for waiter in back:
                if not waiter.done():
                    waiter.set_result(None)


class Malformed(Exception):
    """The batch function answered, but not with one JSON value per input."""


def run_checked(fn: BatchFn, params: Mapping[str, Any] | None, inputs: list[str]) -> list[Any]:
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


def who(request: QueuedRequest) -> Who:
    return (request.tenant, request.request_id, request.part)


def padded(batch: list[QueuedRequest]) -> int:
    """What a padded batch computes over: its size times its longest input."""
    return len(batch) * max(request.tokens for request in batch)
