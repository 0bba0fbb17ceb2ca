"""The one source of time for the engine and everything under it.

Deadlines, linger and spacing, the watchdog, probe back-off and drain all read `time()` and
arm `call_at` timers here, never the loop directly, so a test can hand the engine a
`FakeClock` and move time itself: every timed rule is then checked in virtual time, with no
real sleeps and no threshold that depends on how fast the machine is. `LoopClock` (the
default) is the event loop's monotonic clock; it attaches to the loop when the engine starts.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any, Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Timer: ...


class LoopClock:
    """The running loop's clock (monotonic; uvloop's ticks in milliseconds).

    Once attached, `time` and `call_at` are the loop's own bound methods, not wrappers:
    every request reads the clock several times and arms a timer, and a wrapper costs a
    Python call each time."""

    def __init__(self) -> None:
        self.time: Callable[[], float] = _not_started
        self.call_at: Callable[..., Timer] = _not_started

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.time = loop.time
        self.call_at = loop.call_at


def _not_started(*args: object) -> Any:
    raise RuntimeError("the clock is read, and timers armed, only once the engine has started")


class FakeClock:
    """Virtual time for tests: it stands still until `advance` moves it.

    Timers run in order of their time (then of arming) inside `advance`, each with the clock
    set to its own time, so a test sees exactly the order a real clock would give; one armed
    for a time already past runs on the next loop pass.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _FakeTimer]] = []
        self._order = itertools.count()

    def __repr__(self) -> str:
        return f"<FakeClock now={self._now:.6f} timers={len(self._timers)}>"

    def time(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Timer:
        timer = _FakeTimer(callback, args)
        if when <= self._now:
            # Already due, as a real loop's timer would be: it runs on the next loop pass.
            asyncio.get_running_loop().call_soon(timer.fire)
        else:
            heapq.heappush(self._timers, (when, next(self._order), timer))
        return timer

    def advance(self, seconds: float) -> None:
        """Moves time forward, running every timer that falls due on the way."""
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            timer.fire()
        self._now = target

    def next_timer(self) -> float | None:
        """When the earliest live timer is due: what a test advances to."""
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None


class _FakeTimer:
    def __init__(self, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self._callback = callback
        self._args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._callback(*self._args)


async def sleep_until(clock: Clock, when: float) -> None:
    """Waits until `clock` reaches `when`."""
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    timer = clock.call_at(when, _wake, waiter)
    try:
        await waiter
    finally:
        timer.cancel()


async def wait_until(clock: Clock, future: asyncio.Future[Any], when: float) -> bool:
    """Waits for `future` until `clock` reaches `when`; True if it is done. Never cancels it."""
    if future.done():
        return True
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    wake = lambda _: _wake(waiter)  # noqa: E731
    future.add_done_callback(wake)
    timer = clock.call_at(when, _wake, waiter)
    try:
        await waiter
    finally:
        timer.cancel()
        future.remove_done_callback(wake)
    return future.done()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
