"""A device as the pool holds it: its thread, the versions loaded on it, the batch it runs,
its busy time, its turns for the pool's own calls, and (inherited) its health; and the one
checked call that every batch, warm-up and probe makes on a device's thread."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..batching.request import QueuedRequest
from ..models.registry import Key, ModelVersion
from ..models.specs import BatchFn
from .health import HEALTHY, DeviceHealth, DeviceState, Who
from .thread import DeviceThread

BUSY_WINDOW_S = 10.0
"""The busy ratio's window."""


@dataclass(eq=False)
class Device(DeviceHealth):
    """A device: its thread, what it holds and runs, and (inherited, so that the hot paths
    read `device.state` directly) its health, which `Health` moves."""

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
    """Calls of the pool's own (a new version's warm-up) waiting for the device to be free:
    each takes it before the batcher can, once the call inside has returned."""

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
        """Takes the device (busy, holding no batch) for a call of the pool's own as soon
        as it is free; False if it leaves service first (hung, failing)."""
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
