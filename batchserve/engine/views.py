"""The engine's read-only views, for doors, operators and tests: readiness, the devices'
states, the models, the counts of `stats()`. Nothing here changes what the engine does.

The engine holds one as `engine.view`; a door that only reads is handed it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ..batcher import Batcher
from ..batching.request import Result
from ..batching.snapshot import BatcherStats
from ..errors import InvalidInput, ModelNotFound
from ..generation.models import Generators
from ..gpu_pool import GpuPool
from ..models.registry import Registry, TextKind
from ..models.retrieval import TextModel
from .intake import Intake, Phase


@dataclass(frozen=True, slots=True)
class EngineStats(BatcherStats):
    pending: int
    """Accepted and not yet released by whoever waits for them."""


class EngineView:
    def __init__(
        self,
        intake: Intake,
        registry: Registry,
        generators: Generators,
        pool: GpuPool,
        batcher: Batcher,
    ) -> None:
        self._intake = intake
        self._registry = registry
        self._generators = generators
        self._pool = pool
        self._batcher = batcher

    def readiness(self) -> tuple[bool, str]:
        """Ready while serving with at least one healthy device; else why not."""
        phase = self._intake.phase
        if phase is Phase.READY and self._pool.devices and not self._pool.healthy:
            return False, "no healthy device"
        return phase is Phase.READY, phase.value

    def device_states(self) -> dict[str, str]:
        """Each batch device's state, and each generation device's (busy while it steps)."""
        return self._pool.states() | self._generators.states()

    def stats(self) -> EngineStats:
        return self._with_pending(self._batcher.stats())

    async def wait_until(self, predicate: Callable[[EngineStats], bool]) -> None:
        """Returns once `predicate(stats())` holds; checked whenever the state changes."""
        await self._batcher.wait_until(lambda stats: predicate(self._with_pending(stats)))

    def _with_pending(self, stats: BatcherStats) -> EngineStats:
        return EngineStats(**asdict(stats), pending=len(self._intake.pending))

    @property
    def call_time_s(self) -> float | None:
        """The first model version's measured batch time: what its spacing, watchdog and
        shedding use (None without batch models)."""
        first = next(iter(self._registry), None)
        return None if first is None else first.estimate.seconds

    def capacity_rps(self) -> float | None:
        return self._batcher.capacity_rps()

    def models(self) -> list[dict[str, Any]]:
        """Each model, its versions, their devices, weights and state; batch models first."""
        return self._registry.describe() + self._generators.describe()

    def embedding_dim(self, model: str) -> int:
        """The length of the vectors `model` returns; InvalidInput if it returns none."""
        try:
            return self._registry.embedding_dim(model)
        except ModelNotFound:
            if model in self._generators:
                raise InvalidInput(
                    f"model {model} generates text, not embedding vectors: POST /v1/completions"
                ) from None
            raise

    def dimensions(self, model: str) -> frozenset[int]:
        """The vector lengths a request may ask of `model` (Matryoshka sizes it declares)."""
        self.embedding_dim(model)  # a generation model's name: said so
        return self._registry.dimensions(model)

    def text_model(self, model: str | None, kind: TextKind) -> tuple[str, TextModel]:
        """The name and retrieval facts (tokenizer, longest input, labels) of `model`, or of
        the one model of `kind` where none is named."""
        return self._registry.text_model(model, kind)

    def count_tokens(self, result: Result, text: str) -> int:
        """`text`'s length in the tokens of the version that answered `result`."""
        version = self._registry.get(result.model, result.version)
        return len(text) if version is None else version.tokens(text)

    @property
    def faults(self) -> Counter[str]:
        """Device and batch faults by kind (read-only)."""
        return Counter(self._pool.faults)

    @property
    def recoveries(self) -> Counter[str]:
        """Requests retried or failed after a fault, by kind (read-only)."""
        return Counter(self._batcher.recoveries)
