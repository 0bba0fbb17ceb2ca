"""A device's one worker thread, which hands each call's outcome back to the event loop.

A daemon thread of our own rather than a single-worker ThreadPoolExecutor: a wedged GPU call
cannot be killed, and an executor's threads are joined at interpreter exit, so one hung call
would keep the process alive forever after a clean drain. Nothing waits for this thread at
exit; the pool only ever abandons a call that has run past its budget.
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


class DeviceThread:
    """Runs calls one at a time, in the order they were submitted; each outcome goes back to
    the loop that started the thread."""

    def __init__(self, device: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"batchserve-{device}", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
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
        self.submitted += 1
        self._jobs.put((future, fn, arg))
        return future

    def _work(self) -> None:
        loop = self._loop
        assert loop is not None
        while (job := self._jobs.get()) is not None:
            future, fn, arg = job
            try:
                outcome = functools.partial(_set_result, future, fn(arg))
            except Exception as exc:
                outcome = functools.partial(_set_exception, future, exc)
            self.returned += 1
            # The loop may have closed while a hung call ran: nobody waits for it any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(outcome)


def _set_result(future: asyncio.Future[Any], result: object) -> None:
    if not future.done():  # cancelled when the pool closed
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
