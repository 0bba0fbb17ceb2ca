"""One admission for both schedulers: what a batch request and a generation each pass, in
one order, before the batcher or a generation model takes it.

    the caller's rate (its tenant's tokens) -> the engine's phase -> the model version,
    and room for it (a healthy device; a generation line under the queue bound) -> the
    input -> the deadline -> the request id, unique among those in flight

The rules themselves are pure and live in `rules/admission.py` (keys, rates, input, timeout;
`now` passed in); here they meet the engine's state: its phase, its versions and the ids in
flight. What is particular to a scheduler (a batch's compatibility key, a generation's token
budget) is its own, after this.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar

from ..batching.request import QueuedRequest
from ..config import Config
from ..errors import DuplicateRequestId, InvalidInput, ModelNotFound, NotReady, Overloaded
from ..generation.models import GenerationModel, Generators
from ..generation.request import Generation
from ..gpu_pool import GpuPool
from ..models.registry import ModelVersion, Registry
from ..rules.admission import Admission
from ..rules.tenants import Tenant


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    """One of the engine's tasks crashed: nothing more is served."""


InFlightKey = tuple[str, str, bool]
"""(tenant, request id, whether it is one part of a request of several)."""


def in_flight(tenant: Tenant | None, request_id: str, part: bool = False) -> InFlightKey:
    return ("" if tenant is None else tenant.id_scope, request_id, part)


Target = TypeVar("Target", ModelVersion, GenerationModel)


Route = Callable[[str | None, str | None, str], Target]
"""A scheduler's routing: (model, version, request id) to the version that runs the request,
with room for it."""


class Intake:
    def __init__(
        self,
        config: Config,
        registry: Registry,
        generators: Generators,
        pool: GpuPool,
        capacity_rps: Callable[[], float | None],
    ) -> None:
        self.rules = Admission(config)
        self._max_queue = config.max_queue
        self._registry = registry
        self._generators = generators
        self._pool = pool
        self._device_count = len(pool.devices)
        self._capacity_rps = capacity_rps
        self.phase = Phase.STARTING
        self.takes_stragglers = False
        """Draining for a server whose doors are closed: see Engine.drain(refuse_new=False)."""
        self.pending: dict[InFlightKey, QueuedRequest] = {}
        """Batch requests in flight by their namespace: a tenant's ids are its own, so
        another tenant's id looks unknown (never 409), and an embedding's parts are apart
        from every id a client can send."""
        self.generating: dict[InFlightKey, Generation] = {}
        """Generations in flight, in the same namespace."""

    def __repr__(self) -> str:
        return (
            f"<Intake {self.phase.value} pending={len(self.pending)}"
            f" generating={len(self.generating)}>"
        )

    def configure(self, rules: Admission, config: Config) -> None:
        """A reload: these rules and this queue bound for requests admitted from now on."""
        self.rules = rules
        self._max_queue = config.max_queue

    def require_ready(self) -> None:
        if self.phase is not Phase.READY:
            raise NotReady(f"the server is {self.phase.value}")

    def admit(
        self,
        route: Route[Target],
        model: str | None,
        version: str | None,
        text: str,
        timeout_ms: float | None,
        request_id: str,
        tenant: Tenant | None,
        arrival: float,
        part: bool = False,
        first_token: bool = False,
        spends: int = 1,
    ) -> tuple[Target, float, InFlightKey]:
        """The checks of both schedulers, in the module's order: the version that runs the
        request (by `route`: `batch_version` or `generation_model`), its deadline (for its
        answer, or for a generation's `first_token`) and its key among those in flight; a
        refusal raises `errors.py`'s. `spends`: what the request spends of its tenant's rate
        (a list's first part spends the whole list's, the others none)."""
        self.spend(tenant, arrival, spends)
        self.check_phase()
        target = route(model, version, request_id)
        self.rules.check_input(text)
        deadline = arrival + self.rules.timeout_s(timeout_ms, tenant, first_token=first_token)
        key = in_flight(tenant, request_id, part)
        if key in self.pending or key in self.generating:
            raise DuplicateRequestId(f"request id {request_id} is already in flight")
        return target, deadline, key

    def check_phase(self) -> None:
        """Refuses a request unless the engine takes it now: ready, or draining for a server
        whose doors are closed."""
        if self.phase is not Phase.READY and not (
            self.phase is Phase.DRAINING and self.takes_stragglers
        ):
            raise NotReady(f"the server is {self.phase.value}")

    def spend(self, tenant: Tenant | None, arrival: float, spends: int) -> None:
        """Spends `spends` of the tenant's rate, or refuses (rules/admission.py)."""
        if tenant is not None and spends:
            self.rules.take_tokens(tenant, arrival, self._capacity_rps, spends)

    def batch_version(
        self, model: str | None, version: str | None, request_id: str
    ) -> ModelVersion:
        """The batch version a request runs on, with a healthy device for it."""
        try:
            chosen = self._registry.route(model, version, request_id)
        except ModelNotFound:
            if model in self._generators:  # looked for only once routing has failed
                raise InvalidInput(
                    f"model {model} generates text: POST /api/generate or /v1/completions"
                ) from None
            raise
        if not self._pool.healthy or (
            len(chosen.loaded_on) < self._device_count and not self._pool.healthy_for(chosen)
        ):
            raise NotReady(f"no device of {chosen.spec.label} is healthy; see /readyz")
        return chosen

    def generation_model(
        self, model: str | None, version: str | None, request_id: str
    ) -> GenerationModel:
        """The generation model a request runs on, with its line under the queue bound."""
        try:
            chosen = self._generators.route(model, version, request_id)
        except ModelNotFound:
            if model is not None and model in self._registry:
                raise InvalidInput(
                    f"model {model[:64]} runs batches, not generation: POST /api/inference"
                ) from None
            raise
        dead = chosen.dead_devices
        if len(dead) == len(chosen.loops):  # queued, it would wait for them forever
            verb = "is" if len(dead) == 1 else "are"
            raise NotReady(
                f"no device can run {chosen.spec.label}: {', '.join(dead)} {verb} dead (a model"
                " placed there failed to load at start-up); see /readyz"
            )
        if chosen.waiting >= self._max_queue:
            raise Overloaded(
                f"{chosen.waiting} generations are waiting, the limit", retry_after_s=1.0
            )
        return chosen
