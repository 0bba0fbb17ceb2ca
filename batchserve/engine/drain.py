"""The end of an engine's serving, planned or not: a drain that answers every accepted
request, and a crash of a supervised task that fails everything held and says why.

Both turn readiness off first (the intake's phase), so that nothing new is admitted while
what is held is answered. The engine holds one and hands `drain` on.
"""

from __future__ import annotations

import asyncio
import logging

from ..batcher import Batcher
from ..batching.snapshot import BatcherStats
from ..clock import Clock, wait_until
from ..errors import BatchserveError, NotReady
from ..generation.models import Generators
from ..gpu_pool import GpuPool
from .intake import Intake, Phase

log = logging.getLogger("batchserve.engine.core")
"""The engine's logger, as before this moved out of core.py: operators filter on it."""


class Drain:
    def __init__(
        self,
        clock: Clock,
        intake: Intake,
        batcher: Batcher,
        pool: GpuPool,
        generators: Generators,
        no_generations: asyncio.Event,
        no_counting: asyncio.Event,
    ) -> None:
        self._clock = clock
        self._intake = intake
        self._batcher = batcher
        self._pool = pool
        self._generators = generators
        self._no_generations = no_generations
        self._no_counting = no_counting
        """No list is being counted: one that is will be admitted, and must be answered."""
        self.failed = asyncio.Event()
        """Set when one of the engine's tasks crashed; `failure` says which and why."""
        self.failure: str | None = None
        self._drained: asyncio.Task[None] | None = None

    async def drain(self, timeout_s: float, *, refuse_new: bool = True) -> None:
        """See Engine.drain; what has not run `timeout_s` after the first call is answered
        503."""
        if self._drained is None:
            # Readiness turns off now, not when the task first runs.
            if self._intake.phase is not Phase.FAILED:
                self._intake.phase = Phase.DRAINING
            self._intake.takes_stragglers = not refuse_new
            deadline = self._clock.time() + timeout_s
            self._drained = asyncio.create_task(self._drain(deadline), name="batchserve-drain")
        await asyncio.shield(self._drained)

    async def _drain(self, deadline: float) -> None:
        idle = asyncio.gather(self._no_batches(), self._no_generations.wait())
        if not await wait_until(self._clock, idle, deadline):
            idle.cancel()
            log.warning("drain timed out: answering %d requests 503", len(self._intake.pending))
            self._fail_everything(NotReady("the server shut down before this request could run"))
        await asyncio.gather(idle, return_exceptions=True)

    async def _no_batches(self) -> None:
        """Until the batcher is idle with no list being counted, at one moment: a list is
        admitted the moment its count is back, so an idle batcher alone is not enough."""

        def idle(stats: BatcherStats) -> bool:
            return stats.queued == 0 and stats.in_flight == 0

        while True:
            await self._no_counting.wait()
            await self._batcher.wait_until(idle)
            if self._no_counting.is_set() and idle(self._batcher.stats()):
                return

    def crashed(self, task_name: str, error: BaseException) -> None:
        """A supervised task died: nothing can be served any more, so say so everywhere."""
        log.critical(
            "%s crashed (%s: %s): the engine is failed and stops serving",
            task_name,
            type(error).__name__,
            error,
            exc_info=error,
        )
        self._intake.phase = Phase.FAILED
        self.failure = f"{task_name} crashed: {type(error).__name__}: {error}"
        self._fail_everything(NotReady(f"the server failed ({self.failure})"))
        self.failed.set()

    def _fail_everything(self, error: BatchserveError) -> None:
        self._batcher.fail_queued(error)
        self._pool.fail_in_flight(error)
        self._generators.fail_all(error, self._clock.time())
