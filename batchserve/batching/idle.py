"""The Batch API's lines waiting in the batcher: a tier below every online one.

A line (a request of IDLE_RANK: `rules/tenants.py`) waits here, apart from the online lanes,
so that it neither counts against the queue bound nor shapes an online batch. The batcher
asks for an idle batch only once no online lane would send now (`Batcher._run`), and `take`
gives one only for a version none of whose devices an online request waits for: a line
never rides in an online batch, and online work arriving finds at most the one batch call
in hand on a device ahead of it (a device runs one call at a time; the call prepared to
follow it, `devices/prepared.py`, is withdrawn as online work arrives, its lines back here
first: `back`). That call is kept short:
it holds only as many lines as its version's estimate predicts done within `call_s`
(`--idle-call-ms`), at least one (`call_size`). What ran is counted for the metrics: lines
waiting, running, done, and the device seconds they used.

The lines of a failed idle call come back here too (`again`), in the groups their rescue
planned (`batching/rescue.py`): they run only as fresh lines do, in idle time, never in the
online retry lane that goes before new work, nor riding in an online batch.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Collection
from typing import NamedTuple, Protocol

from ..errors import BatchserveError
from ..models.registry import Key, ModelVersion
from ..rules.capacity import most_within
from .request import QueuedRequest


class IdleCounts(NamedTuple):
    """What the metrics read of the idle lines at a scrape."""

    waiting: int
    running: int
    done: int
    device_s: float
    """Device seconds the lines' batch calls took, in all."""
    online_wait_s: float
    """Seconds a free device stood while online requests waited for it: not idle capacity
    (`batching/online_wait.py`)."""


class Limits(Protocol):
    """What an idle call's size is read from: the lane its lines' key would have."""

    @property
    def key(self) -> Key: ...

    @property
    def max_batch(self) -> int: ...

    def predicted_s(self, size: int) -> float | None: ...


def call_size(limits: Limits, call_s: float) -> int:
    """The lines of one idle call: the most, up to a full batch, predicted done within
    `call_s`, and at least one. A full batch for a flat-cost model (its calls take the same
    at any size: a smaller one would be no shorter), and for any model until a call has been
    timed (nothing measured: no grounds to shrink it). A length-cost model whose calls were
    all of one size so far is predicted their mean at any size: past `call_s` that gives one
    line, and the estimate learns its slope from the calls of two sizes."""
    if limits.key.version.spec.cost != "length" or limits.predicted_s(1) is None:
        return limits.max_batch
    return most_within(limits.predicted_s, 1, limits.max_batch, call_s)


class IdleLines:
    def __init__(self, call_s: float) -> None:
        self.call_s = call_s
        """The longest an idle call should take, predicted: what online work may find ahead."""
        self._waiting: dict[Key, dict[QueuedRequest, None]] = {}
        self._again: deque[tuple[Key, list[QueuedRequest]]] = deque()
        """Groups of failed idle calls to run again, oldest first, and of withdrawn ones:
        before fresh lines."""
        self.held = 0
        """Lines in calls prepared to follow the one in hand: still waiting, as counted."""
        self.running = 0
        self.done = 0
        self.device_s = 0.0

    def __bool__(self) -> bool:
        """Whether lines wait: cheaper than counting them, and the batcher asks at every
        change of its state."""
        return bool(self._waiting) or bool(self._again)

    def __len__(self) -> int:
        fresh = sum(len(waiting) for waiting in self._waiting.values())
        return fresh + sum(len(group) for _, group in self._again)

    def __repr__(self) -> str:
        return f"<IdleLines waiting={len(self)} running={self.running} done={self.done}>"

    def counts(self, online_wait_s: float) -> IdleCounts:
        return IdleCounts(
            len(self) + self.held, self.running, self.done, self.device_s, online_wait_s
        )

    def versions(self) -> set[ModelVersion]:
        return {key.version for key in itertools.chain(self._waiting, (k for k, _ in self._again))}

    def push(self, request: QueuedRequest) -> None:
        self._waiting.setdefault(request.key, {})[request] = None

    def again(self, key: Key, group: list[QueuedRequest]) -> None:
        """A group of a failed idle call, to run again as it is in idle time."""
        self._again.append((key, group))

    def hold(self, count: int) -> None:
        """`count` lines taken went into a prepared call: they wait there."""
        self.held += count

    def back(self, key: Key, group: list[QueuedRequest]) -> None:
        """The lines of a prepared call, withdrawn before it started: they go first."""
        self.held -= len(group)
        self._again.appendleft((key, group))

    def discard(self, request: QueuedRequest) -> None:
        waiting = self._waiting.get(request.key)
        if waiting is not None and request in waiting:
            del waiting[request]
            if not waiting:
                del self._waiting[request.key]

    def take(
        self,
        busy_online: Collection[ModelVersion],
        free_for: Callable[[ModelVersion], int],
        limits: Callable[[Key], Limits],
    ) -> tuple[Key, list[QueuedRequest]] | None:
        """A group to run again, else the oldest lines of a key (`call_size` of them, by its
        `limits`), whose version has a free device and shares none with an online request
        waiting (`busy_online`); None if no key may run now. What a group holds may have
        been answered since (the caller leaves those out)."""
        for index, (key, group) in enumerate(self._again):
            if key.version not in busy_online and free_for(key.version):
                del self._again[index]
                return key, group
        for key, waiting in self._waiting.items():
            if key.version in busy_online or not free_for(key.version):
                continue
            batch = list(itertools.islice(waiting, call_size(limits(key), self.call_s)))
            for request in batch:
                del waiting[request]
            if not waiting:
                del self._waiting[key]
            return key, batch
        return None

    def fail(self, error: BatchserveError, version: ModelVersion | None = None) -> None:
        """Answers every waiting line (of `version`, if given) with `error`."""
        mine = [k for k in self._waiting if version in (None, k.version)]
        failed = [request for key in mine for request in self._waiting.pop(key)]
        for key, group in list(self._again):
            if version in (None, key.version):
                self._again.remove((key, group))
                failed += group
        for request in failed:
            if not request.future.done():
                request.future.set_exception(error)

    def sent(self, count: int, *, held: bool = False) -> None:
        """`count` lines started: taken, or `held` in a prepared call until now."""
        if held:
            self.held -= count
        self.running += count

    def ended(self, count: int, device_s: float | None) -> None:
        """A call of `count` lines ended: ran for `device_s`, or failed (None; its rescue
        may send them again)."""
        self.running -= count
        if device_s is not None:
            self.done += count
            self.device_s += device_s
