"""A device's one worker thread, which hands each call's outcome back to the event loop.

A daemon thread of our own rather than a single-worker ThreadPoolExecutor: a wedged GPU call
cannot be killed, and an executor's threads are joined at interpreter exit, so one hung call
would keep the process alive forever after a clean drain. Nothing waits for this thread at
exit; the pool only ever abandons a call that has run past its budget.

A call may have a successor prepared (`prepare`): the thread starts it the moment the call
returns, without the round trip through the loop that a submitted call waits for (the
loop hears of the end, decides, submits), and the loop can take it back (`withdraw`) until
then. The pool uses it for the Batch API's idle calls (`gpu_pool.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

Arg = TypeVar("Arg")
Ret = TypeVar("Ret")

_Job = tuple["asyncio.Future[Any]", Callable[[Any], Any], Any]


class Next:
    """A call prepared to start as the one in hand returns: withdrawn, or started (then
    `number` is its place in the thread's count of calls, as `submitted` gives others)."""

    __slots__ = ("arg", "fn", "future", "number")

    def __init__(self, future: asyncio.Future[Any], fn: Callable[[Any], Any], arg: Any) -> None:
        self.future, self.fn, self.arg = future, fn, arg
        self.number = 0
        """0 until the thread starts it."""


class DeviceThread:
    """Runs calls one at a time, in the order they were submitted; each outcome goes back to
    the loop that started the thread."""

    def __init__(self, device: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"batchserve-{device}", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        """Orders the loop's submits, prepares and withdrawals against the thread's starts."""
        self._next: Next | None = None
        self.submitted = 0
        """Calls submitted so far: the number of the latest."""
        self.returned = 0
        """Calls that came back, counted on this thread as each returns (before the loop
        hears of it): a watchdog that looks late, on a stalled loop, still sees the device
        answered in time."""

    def __repr__(self) -> str:
        return f"<DeviceThread {self._thread.name} alive={self._thread.is_alive()}>"

    @property
    def started(self) -> bool:
        return self._loop is not None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self) -> None:
        """Lets the thread end after the calls already submitted; does not wait for them."""
        self._jobs.put(None)

    async def join(self, wait_s: float) -> None:
        """Waits, up to `wait_s`, for a stopped thread to end: a process that exits while a
        call is still inside torch can abort in C++ instead of exiting."""
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, wait_s)

    def submit(self, fn: Callable[[Arg], Ret], arg: Arg) -> asyncio.Future[Ret]:
        assert self._loop is not None, "submit only to a started thread"
        future: asyncio.Future[Ret] = self._loop.create_future()
        with self._lock:
            self.submitted += 1
            self._jobs.put((future, fn, arg))
        return future

    def prepare(self, fn: Callable[[Arg], Ret], arg: Arg) -> Next | None:
        """`fn(arg)`, to start the moment the call in hand (the latest submitted) returns
        without raising; None if that call has returned already. Its future is
        `Next.future`."""
        assert self._loop is not None, "prepare only on a started thread"
        with self._lock:
            if self.returned >= self.submitted or self._next is not None:
                return None
            self._next = Next(self._loop.create_future(), fn, arg)
            return self._next

    def withdraw(self, prepared: Next) -> bool:
        """Takes `prepared` back unless it started; True if it never will."""
        with self._lock:
            if prepared.number:
                return False
            if self._next is prepared:
                self._next = None
        prepared.future.cancel()
        return True

    def stalled(self, call: int) -> bool:
        """Whether call number `call` is still inside; if so, what was prepared to follow
        it never starts (the watchdog's verdict: its successor would run on a device out
        of service)."""
        with self._lock:
            if self.returned >= call:
                return False
            self._next = None
            return True

    def _work(self) -> None:
        loop = self._loop
        assert loop is not None
        job = self._jobs.get()
        while job is not None:
            future, fn, arg = job
            try:
                outcome = functools.partial(_set_result, future, fn(arg))
                succeeded = True
            except Exception as exc:
                outcome = functools.partial(_set_exception, future, exc)
                succeeded = False
            with self._lock:
                self.returned += 1
                then = self._take_next() if succeeded else None
            # The loop may have closed while a hung call ran: nobody waits for it any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(outcome)
            job = then if then is not None else self._jobs.get()

    def _take_next(self) -> _Job | None:
        """Under the lock: the prepared call, started now, unless something was submitted
        (a stop) and goes first; then it stays prepared until the loop withdraws it."""
        prepared = self._next
        if prepared is None or not self._jobs.empty():
            return None
        self._next = None
        self.submitted += 1
        prepared.number = self.submitted
        return prepared.future, prepared.fn, prepared.arg


def _set_result(future: asyncio.Future[Any], result: object) -> None:
    if not future.done():  # cancelled when the pool closed
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
