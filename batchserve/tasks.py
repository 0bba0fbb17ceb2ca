"""Supervised tasks: a crash is reported at once, not found at shutdown.

Nobody awaits the batching loop or a batch's finishing task while the engine serves, so an
exception in one would otherwise go unnoticed until exit while requests queue forever behind
a dead loop. Each owner (the batcher, the pool) keeps its tasks in a `TaskSet`: it starts
them, and `aclose` cancels and awaits them; any that ends with an exception is handed to the
engine's `on_crash`, which turns the engine not-ready and makes the server exit non-zero.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine

CrashHandler = Callable[[str, BaseException], None]


class TaskSet:
    def __init__(self, on_crash: CrashHandler) -> None:
        self._on_crash = on_crash
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"<TaskSet running={len(self._tasks)}>"

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, coroutine: Coroutine[object, object, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    async def join(self) -> None:
        """Waits for the tasks running now to end, whichever way they end."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def aclose(self) -> None:
        """Cancels every task still running and waits for each to end."""
        for task in self._tasks:
            task.cancel()
        # gather reports the tasks' own cancellation as results, yet still raises if the
        # task closing us is itself cancelled.
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._on_crash(task.get_name(), error)
