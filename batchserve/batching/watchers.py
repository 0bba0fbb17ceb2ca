"""Waiters on a state: each wakes once its predicate holds. The batcher tells them of every
change it makes (draining waits on it, and tests); a state changed elsewhere, by a device's
thread say, does not wake them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

State = TypeVar("State")


class Watchers(Generic[State]):
    """Predicates over the state `read` returns, checked whenever `changed` is called."""

    def __init__(self, read: Callable[[], State]) -> None:
        self._read = read
        self._waiting: list[tuple[Callable[[State], bool], asyncio.Future[None]]] = []

    async def wait_until(self, predicate: Callable[[State], bool]) -> None:
        """Returns once `predicate(read())` holds."""
        if predicate(self._read()):
            return
        future = asyncio.get_running_loop().create_future()
        watcher = (predicate, future)
        self._waiting.append(watcher)
        try:
            await future
        finally:
            if watcher in self._waiting:
                self._waiting.remove(watcher)

    def changed(self) -> None:
        """Wakes the waiters whose predicate now holds."""
        if not self._waiting:
            return
        state = self._read()
        for watcher in [w for w in self._waiting if w[0](state)]:
            self._waiting.remove(watcher)
            if not watcher[1].done():
                watcher[1].set_result(None)
