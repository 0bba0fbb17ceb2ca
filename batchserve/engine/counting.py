"""A long list's tokens counted off the event loop, before any of it is admitted.

A request of many inputs (an /embed or /rerank of 10,000, a /v1/embeddings of 2048) is
costed by each input's tokens, and a door may want each checked against the model's length:
a second of tokenizer work that, on the loop, would stall every other request, stream,
probe and watchdog meanwhile. So `Engine.infer_all` hands that work here, to one thread
(one, so that counting takes at most one core from the devices' threads), and admits the
whole list in one synchronous pass once it is back: all or nothing, as before. A drain waits
for the lists being counted (`idle`), as it waits for the generations being admitted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..errors import BatchserveError
from ..models.registry import ModelVersion, Registry

INLINE_CHARS = 1024
"""A list of at most this many characters in all is counted on the loop: the hop to the
thread would cost more than the count (as for a generation's prompt)."""

Counted = tuple[ModelVersion | None, int]
"""An input's tokens, and the version that counted them (None: not counted)."""


def worth_a_thread(texts: Sequence[str]) -> bool:
    total = 0
    for text in texts:
        total += len(text)
        if total > INLINE_CHARS:
            return True
    return False


class Counting:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._thread: ThreadPoolExecutor | None = None
        self._busy = 0
        self.idle = asyncio.Event()
        """Set while no list is being counted: what a drain waits for."""
        self.idle.set()

    async def count(
        self,
        texts: Sequence[str],
        ids: Sequence[str],
        model: str | None,
        version: str | None,
        check: Callable[[], None] | None,
    ) -> list[Counted]:
        """Runs `check` (the door's, which may raise), then counts each text's tokens in the
        version its id routes it to, on the counting thread. Routing is done here, on the
        loop; an input it refuses is left uncounted, for admission to refuse."""
        targets = [self._target(model, version, request_id) for request_id in ids]

        def work() -> list[Counted]:
            if check is not None:
                check()
            return [
                (target, target.tokens(text))
                if target is not None and target.spec.cost == "length"
                else (None, 0)
                for target, text in zip(targets, texts, strict=True)
            ]

        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, "batchserve-tokenize-inputs")
        self._busy += 1
        self.idle.clear()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, work)
        finally:
            self._busy -= 1
            if not self._busy:
                self.idle.set()

    def _target(
        self, model: str | None, version: str | None, request_id: str
    ) -> ModelVersion | None:
        try:
            return self._registry.route(model, version, request_id)
        except BatchserveError:
            return None

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
