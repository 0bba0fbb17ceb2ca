"""The batching engine: admission, queue, scheduler, devices, capacity and drain; no HTTP.

    async with Engine(config, fn_per_device=load, devices="cpu") as engine:
        result = await engine.infer("some input", timeout_ms=2000)
        ticket = engine.submit("later")       # poll ticket.status, or await ticket

The HTTP server, the status API and the dashboard are doors onto one engine; a Python
program embeds it the same way. The engine owns, each in one place: admission (`intake.py`,
one order for batch requests and generations, over the pure rules of `rules/admission.py`),
the pending requests and their deadlines, the versions changed while serving (`versions.py`),
the device pool and the batcher (the pool starts first and stops last), the one batch-time
estimate, the metrics, and drain. Everything reads time from one injected clock. Its tasks
are supervised: if one crashes, the engine fails what it holds, turns not-ready and sets
`failed`, which makes the server exit non-zero rather than serve into a dead batcher.

Why `Engine` is over the house's ~25 methods and this module over ~400 lines: it is the
one facade that every door, test and library caller holds, so its public surface (infer,
submit, generate, admit/settle, the admin and reload calls, the read-only views) is about
30 methods, most a few lines handing over to `intake.py`, `versions.py`, the batcher, the
pool or the generation models. The batch request path (`admit`, `_queue`, `settle`) stays
inline here because each further call is paid by every request (benchmarks/README.md,
section 4). The pool's listener methods go once the batcher takes the pool's callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..batcher import Batcher, BatcherStats, length_bucket
from ..batching.deadlines import Deadlines
from ..batching.faults import RetryBudget
from ..batching.request import Ask, QueuedRequest, Result, Ticket, new_request_id
from ..clock import Clock, LoopClock, Timer, wait_until
from ..config import Config
from ..errors import (
    BatchserveError,
    InvalidInput,
    ModelNotFound,
    NotReady,
)
from ..generation.models import GenerationModel, Generators, build_generation_model
from ..generation.request import Generation
from ..gpu_pool import GpuPool
from ..live_config import LiveChanges, live_changes
from ..models.generators import Seq
from ..models.registry import Key, Registry, build_version
from ..models.specs import BatchFn, DeviceFactory, ModelSpec, default_spec, load_models_file
from ..observability.metrics import Metrics
from ..observability.tracing import Tracer, global_provider
from ..rules.admission import Admission, stop_strings
from ..rules.policy import Policy
from ..rules.sampling_params import checked_params
from ..rules.tenants import Tenant
from .intake import InFlightKey, Intake, Phase
from .recorder import Recorder
from .versions import Versions

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

log = logging.getLogger(__name__)

MAX_INPUTS_PER_CALL = 2048
"""The most inputs a door takes in one request for `infer_all` (an embeddings list, an Open
Inference Protocol tensor): OpenAI's own limit on inputs per embeddings request."""


@dataclass(frozen=True, slots=True)
class EngineStats(BatcherStats):
    pending: int
    """Accepted and not yet released by whoever waits for them."""


class Engine:
    def __init__(
        self,
        config: Config | None = None,
        *,
        fn: BatchFn | None = None,
        fn_per_device: DeviceFactory | None = None,
        devices: str | None = None,
        clock: Clock | None = None,
        policy: Policy | None = None,
        models: list[ModelSpec] | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        """The models of `config.models` (a models file) or of `models`; else one model,
        `default`, from `fn` or `fn_per_device` in Python, else `config`'s paths, else the
        simulated model, on `devices` (default `config.devices`). `clock` and `policy` (the
        default model's) are for tests. With `config.trace`, spans go to `tracer_provider`
        (default: OpenTelemetry's global one; observability/tracing.py)."""
        self.config = config = config or Config()
        self.clock = clock or LoopClock()
        if models is None and config.models is not None:
            models = load_models_file(config.models, config)
        from_flags = models is None
        if models is None:
            spec = default_spec(config)
            if devices is not None:
                spec = dataclasses.replace(spec, devices=devices)
            models = [spec]
        versions = [
            build_version(config, spec, fn=fn, fn_per_device=fn_per_device, policy=policy)
            if from_flags
            else build_version(config, spec)
            for spec in models
            if spec.generator is None
        ]
        self._registry = Registry(versions)
        self._generators = Generators(
            [
                build_generation_model(config, spec, clock=self.clock, on_crash=self._crashed)
                for spec in models
                if spec.generator is not None
            ]
        )
        self.started = asyncio.Event()
        """Set once every device has loaded and the engine takes requests."""
        self.failed = asyncio.Event()
        """Set when one of the engine's tasks crashed; `failure` says which and why."""
        self.failure: str | None = None
        self._deadlines = Deadlines(self.clock)
        self._no_generations = asyncio.Event()
        self._no_generations.set()
        self._pool = GpuPool(versions, clock=self.clock, on_crash=self._crashed)
        self.device_names = [device.name for device in self._pool.devices]
        self._batcher = Batcher(
            self._pool,
            clock=self.clock,
            max_queue=config.max_queue,
            bisect_failures=config.bisect_failures,
            retry_budget=RetryBudget(
                ratio=config.retry_budget, reserve=config.retry_reserve, tokens=config.retry_reserve
            ),
            shed=config.keys_file is not None,
            poison_memory=config.poison_memory,
            on_crash=self._crashed,
        )
        self.metrics = (
            Metrics(
                self._batcher,
                self._pool,
                self._registry,
                self._generators,
                clock=self.clock,
                slo_s=config.slo_ms / 1e3,
            )
            if config.metrics
            else None
        )
        if self.metrics is not None:
            self._batcher.on_batch_ran = self.metrics.batch_ran
        self._recorder = Recorder(self.metrics, config.access_log)
        self._intake = Intake(
            config, self._registry, self._generators, self._pool, self._batcher.capacity_rps
        )
        # Each scheduler's routing, bound once: `admit` runs for every request.
        self._batch_route = self._intake.batch_version
        self._generation_route = self._intake.generation_model
        self._tracer: Tracer | None = None
        if config.trace:
            self._tracer = Tracer(tracer_provider or global_provider(), self.clock)
            self._pool.on_call = self._tracer.batch_call
        self._stack = contextlib.AsyncExitStack()
        self._versions = Versions(
            self._registry,
            self._pool,
            self._batcher,
            self.metrics,
            require_ready=self._intake.require_ready,
            on_crash=self._crashed,
        )
        self._drained: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<Engine {self._intake!r} {self._pool!r}>"

    async def __aenter__(self) -> Engine:
        """Loads every device, then starts the batcher; ready once both are up."""
        if isinstance(self.clock, LoopClock):
            self.clock.attach(asyncio.get_running_loop())
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self._pool)
            await stack.enter_async_context(self._batcher)
            await stack.enter_async_context(self._generators)
            self._stack = stack.pop_all()
        self._versions.all_ready()
        self._intake.phase = Phase.READY
        self.started.set()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Drains (every accepted request is answered), then stops the batcher and the
        devices in reverse order of their start."""
        try:
            await self.drain()
        finally:
            self._deadlines.close()
        await self._versions.aclose()
        await self._stack.aclose()

    # Requests

    async def infer(
        self,
        text: str,
        *,
        model: str | None = None,
        version: str | None = None,
        params: Mapping[str, Any] | None = None,
        timeout_ms: float | None = None,
        request_id: str | None = None,
        tenant: Tenant | None = None,
        arrival: float | None = None,
        route: str = "inference",
        part: bool = False,
    ) -> Result:
        """Runs one input in a batch and returns its result; errors are `errors.py`'s.

        `model` may be left out when the engine runs one; `version` pins one of its
        versions (else they share traffic by weight); `params` go to the batch function as
        keyword arguments. `timeout_ms` may only lower the server's `timeout_ms` (and the
        tenant's tier deadline). `arrival` is when the caller received the request
        (default: now); `route` names the door it came through, in metrics and logs.
        `part`: one input of a request of several (an embeddings call), whose id is kept
        apart from every id a client sends.
        """
        # The Ask is not bound, so not kept while the request waits: each object a request
        # keeps for its wait costs the loop (benchmarks/README.md, section 4).
        request, expiry = self.admit(
            route, Ask(text, timeout_ms, model, version, params), request_id, tenant, arrival, part
        )
        outcome: Result | BatchserveError | None = None
        try:
            outcome = await request.future
            return outcome
        except BatchserveError as error:
            outcome = error
            raise
        finally:
            self.settle(route, request, expiry, tenant, outcome)

    async def infer_all(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        version: str | None = None,
        timeout_ms: float | None = None,
        request_id: str,
        tenant: Tenant | None = None,
        arrival: float | None = None,
        route: str = "inference",
    ) -> list[Result]:
        """Runs each of `texts` as one request of `infer`, batched with everyone else's
        (perhaps in different batches); returns their results in the order given, or raises
        the error of the first input (by position) that failed, once all are done. Several
        inputs are `part`s, with ids `<request_id>.<index>`."""
        several = len(texts) > 1
        outcomes = await asyncio.gather(
            *(
                self.infer(
                    text,
                    model=model,
                    version=version,
                    timeout_ms=timeout_ms,
                    request_id=f"{request_id}.{index}" if several else request_id,
                    tenant=tenant,
                    arrival=arrival,
                    route=route,
                    part=several,
                )
                for index, text in enumerate(texts)
            ),
            return_exceptions=True,
        )
        results: list[Result] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
            results.append(outcome)
        return results

    def submit(
        self,
        text: str,
        *,
        model: str | None = None,
        version: str | None = None,
        params: Mapping[str, Any] | None = None,
        timeout_ms: float | None = None,
        request_id: str | None = None,
        tenant: Tenant | None = None,
        arrival: float | None = None,
    ) -> Ticket:
        """Queues one input and returns at once: the ticket tells its status and, awaited,
        gives its result. It runs exactly like `infer` (same queue, deadline, faults)."""
        ask = Ask(text, timeout_ms, model, version, params)
        request, expiry = self.admit("requests", ask, request_id, tenant, arrival)
        ticket = Ticket(request)
        ticket.add_done_callback(functools.partial(self._submitted_done, request, expiry, tenant))
        return ticket

    @contextlib.asynccontextmanager
    async def generate(
        self,
        prompt: str,
        *,
        model: str | None = None,
        version: str | None = None,
        max_tokens: int | None = None,
        stop: str | list[str] | None = None,
        params: Mapping[str, Any] | None = None,
        timeout_ms: float | None = None,
        request_id: str | None = None,
        tenant: Tenant | None = None,
        arrival: float | None = None,
        route: str = "generate",
    ) -> AsyncIterator[Generation]:
        """Starts one generation; read its text as it comes with `gen.pieces()`, or whole
        with `await gen.result()`:

            async with engine.generate("Once upon", max_tokens=50) as gen:
                async for piece in gen.pieces():
                    print(piece, end="")

        A refusal raises on entry (`errors.py`'s, like `infer`'s), among them `params` that
        break `rules/sampling_params.py`'s rules, so the generator never sees them. `timeout_ms`
        bounds the wait for the first token; the sequence then runs to its end. Leaving the
        block before it ends cancels it: its sequence is released before the next step.
        """
        arrival = self.clock.time() if arrival is None else arrival
        request_id = request_id or new_request_id()
        try:
            generation_model, gen, in_flight = self._generation(
                prompt, model, version, max_tokens, stop, params, timeout_ms,
                request_id, tenant, arrival,
            )  # fmt: skip
        except BatchserveError as error:
            self.record(route, request_id, arrival, error, tenant)
            raise
        self._no_generations.clear()
        self._intake.generating[in_flight] = gen
        generation_model.submit(gen)
        expiry = self.clock.call_at(gen.deadline, self._expire, generation_model, gen)
        try:
            yield gen
        finally:
            expiry.cancel()
            if not gen.done:
                gen.cancel()
                generation_model.discard(gen)
            del self._intake.generating[in_flight]
            if not self._intake.generating:
                self._no_generations.set()
            now = self.clock.time()
            self._recorder.record_generation(route, tenant, gen, now)
            if self._tracer is not None:
                self._tracer.generation(route, gen)

    def _generation(
        self,
        prompt: str,
        model: str | None,
        version: str | None,
        max_tokens: int | None,
        stop: str | list[str] | None,
        params: Mapping[str, Any] | None,
        timeout_ms: float | None,
        request_id: str,
        tenant: Tenant | None,
        arrival: float,
    ) -> tuple[GenerationModel, Generation, InFlightKey]:
        """Admits a generation as `_queue` admits a batch request (intake.py), then checks
        its tokens: a prompt that can never fit a device's budget is refused at once (413)."""
        generation_model, deadline, in_flight = self._intake.admit(
            self._generation_route, model, version, prompt, timeout_ms, request_id, tenant, arrival
        )
        prompt_tokens = generation_model.count_tokens(prompt)
        rules = self._intake.rules
        limit = rules.new_tokens(prompt_tokens, max_tokens, generation_model.kv_budget)
        sampling = checked_params(params, limit)
        gen = Generation(
            # The sequence's id is the generator's handle, unique across tenants.
            Seq(_seq_id(tenant, request_id), prompt, params=sampling),
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            max_tokens=limit,
            stops=stop_strings(stop),
            arrival=arrival,
            deadline=deadline,
            model=generation_model.spec.name,
            version=generation_model.spec.version,
        )
        if tenant is not None:
            gen.tenant, gen.tier_rank = tenant.name, tenant.rank
            gen.tenant_weight = tenant.weight
        return generation_model, gen, in_flight

    def chat_prompt(self, model: str | None, messages: list[dict[str, str]]) -> str:
        """A chat's messages as one prompt, in the template of `model`'s generator."""
        return self._generators.route(model, None, "").chat_prompt(messages)

    def _expire(self, generation_model: GenerationModel, gen: Generation) -> None:
        gen.expire(self.clock.time())
        if gen.cancelled:
            generation_model.discard(gen)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The caller's tenant from `Authorization: Bearer <key>`; None when the engine runs
        open (no keys file)."""
        return self._intake.rules.authenticate(authorization)

    def gateway_tenant(
        self, headers: Mapping[str, str], authenticated: Tenant | None
    ) -> Tenant | None:
        """The tenant, tier and deadline cap the Kubernetes inference gateway's headers give
        a request, with --trust-gateway-headers on; else `authenticated` (gateway.py)."""
        return self._intake.rules.gateway_tenant(headers, authenticated)

    def authorize_operator(self, authorization: str | None) -> None:
        """Raises Unauthenticated unless the caller may read the server's numbers."""
        self._intake.rules.authorize_operator(authorization)

    def record(
        self,
        route: str,
        request_id: str,
        arrival: float,
        outcome: Result | BatchserveError,
        tenant: Tenant | None,
    ) -> None:
        """Counts an answer in the metrics and the access log; doors call it for what they
        refuse before the engine sees the request."""
        now = self.clock.time()
        self._recorder.record(route, request_id, tenant, now - arrival, outcome, now)

    def admit(
        self,
        route: str,
        ask: Ask,
        request_id: str | None,
        tenant: Tenant | None,
        arrival: float | None,
        part: bool = False,
    ) -> tuple[QueuedRequest, Timer | None]:
        """Queues the request and arms its deadline (the timer to cancel, if it has one of
        its own); a refusal is recorded under `route` and raised.

        `infer` in parts, for a door that awaits the request's future itself and then hands
        its outcome to `settle`: `infer`'s coroutine would be one more object each waiting
        request keeps (benchmarks/README.md, section 4)."""
        arrival = self.clock.time() if arrival is None else arrival
        request_id = request_id or new_request_id()
        try:
            return self._queue(ask, request_id, tenant, arrival, part)
        except BatchserveError as error:
            self.record(route, request_id, arrival, error, tenant)
            raise

    def _queue(
        self, ask: Ask, request_id: str, tenant: Tenant | None, arrival: float, part: bool
    ) -> tuple[QueuedRequest, Timer | None]:
        """Admits the request (intake.py), then queues it and arms its deadline."""
        text = ask.text
        version, deadline, in_flight = self._intake.admit(
            self._batch_route, ask.model, ask.version, text, ask.timeout_ms,
            request_id, tenant, arrival, part,
        )  # fmt: skip
        params_key = version.params_key(ask.params) if ask.params is not None else b""
        if version.spec.cost == "length":
            tokens = max(1, version.tokens(text))
            key = Key(version, params_key, length_bucket(version, tokens), ask.params or None)
        else:
            tokens = 1
            key = Key(version, params_key, 0, ask.params) if params_key else version.plain_key
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        request = QueuedRequest(request_id, text, arrival, deadline, future, key, tokens)
        if tenant is not None:
            request.tenant, request.tier_rank = tenant.name, tenant.rank
            request.tenant_weight = tenant.weight
        self._batcher.submit(request)
        request.part = part
        self._intake.pending[in_flight] = request
        # Its deadline fails the future, rather than asyncio.timeout_at: the hot path then
        # needs no Timeout object and no task-cancel round trip.
        return request, self._deadlines.add(request)

    def settle(
        self,
        route: str,
        request: QueuedRequest,
        expiry: Timer | None,
        tenant: Tenant | None,
        outcome: Result | BatchserveError | None,
    ) -> None:
        """Forgets a request of `admit` whose waiter is done with it, and records its
        outcome: its result, the error it was answered with, or None for a waiter that left
        with nothing answered. Still queued (a timeout, a disconnect), it leaves the queue
        before any batch is formed."""
        if expiry is not None:
            expiry.cancel()
        del self._intake.pending[request.tenant, request.request_id, request.part]
        self._batcher.discard(request)
        if self._tracer is not None:
            self._tracer.request(route, request, outcome)
        if outcome is not None:
            self.record(route, request.request_id, request.arrival, outcome, tenant)

    def _submitted_done(
        self, request: QueuedRequest, expiry: Timer | None, tenant: Tenant | None, ticket: Ticket
    ) -> None:
        self.settle("requests", request, expiry, tenant, ticket.outcome())

    # Versions added, reweighted and removed while serving (the admin API): see versions.py

    def add_version(self, spec: ModelSpec) -> dict[str, Any]:
        """Loads a new version in the background (beside what serves); it takes traffic
        once every device has loaded it and answered a warm-up batch."""
        return self._versions.add(spec, self.config)

    def set_weight(self, name: str, version_name: str, weight: float) -> dict[str, Any]:
        return self._versions.set_weight(name, version_name, weight)

    def remove_version(self, name: str, version_name: str) -> dict[str, Any]:
        """Stops new traffic to a version at once; what it holds finishes, then it unloads
        and its devices' memory is freed."""
        return self._versions.remove(name, version_name)

    async def settled(self) -> None:
        """Returns once the loads and unloads under way have finished."""
        await self._versions.settled()

    def reconfigure(self, wanted: Config) -> LiveChanges:
        """Applies what a running server can change of `wanted` (see live_config.py), or
        nothing: a keys or models file that does not load raises StartupError first.

        Limits, timeouts, the queue bound, keys and tiers apply to requests admitted from
        now on (rate buckets start full); batch limits to batches formed from now on; the
        models file's versions are added, drained, reweighted and retuned as by the admin
        API. The settings that need a restart keep their running values (`kept`)."""
        changes = live_changes(self.config, wanted)
        config = changes.config
        admission = Admission(config)
        models = self._versions.plan(config)
        self.config = config
        self._intake.configure(admission, config)
        self._batcher.max_queue = config.max_queue
        self._recorder = Recorder(self.metrics, config.access_log)
        self._versions.apply(models, config)
        return LiveChanges(config, changes.changed, [*changes.kept, *models.kept])

    # Lifecycle

    async def drain(self, *, refuse_new: bool = True) -> None:
        """Turns readiness off, stops taking requests and answers every accepted one; safe
        to call twice. What has not run `drain_timeout_s` after the drain began is answered
        503.

        `refuse_new=False` is for a server that has already closed its doors (listeners
        closed, each connection closing after the request in hand): what still arrives was
        sent before the drain began, at most one request per connection, and is served
        rather than answered 503 (nginx does not retry a 503)."""
        if self._drained is None:
            # Readiness turns off now, not when the task first runs.
            if self._intake.phase is not Phase.FAILED:
                self._intake.phase = Phase.DRAINING
            self._intake.takes_stragglers = not refuse_new
            deadline = self.clock.time() + self.config.drain_timeout_s
            self._drained = asyncio.create_task(self._drain(deadline), name="batchserve-drain")
        await asyncio.shield(self._drained)

    async def _drain(self, deadline: float) -> None:
        idle = asyncio.gather(
            self._batcher.wait_until(lambda s: s.queued == 0 and s.in_flight == 0),
            self._no_generations.wait(),
        )
        if not await wait_until(self.clock, idle, deadline):
            idle.cancel()
            log.warning("drain timed out: answering %d requests 503", len(self._intake.pending))
            self._fail_everything(NotReady("the server shut down before this request could run"))
        await asyncio.gather(idle, return_exceptions=True)

    def _crashed(self, task_name: str, error: BaseException) -> None:
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
        self._generators.fail_all(error, self.clock.time())

    # Read-only views, for doors, operators and tests

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


def _seq_id(tenant: Tenant | None, request_id: str) -> str:
    """A generation's id for its generator: the request's, made unique across tenants."""
    if tenant is None:
        return request_id
    return f"{len(tenant.name)}:{tenant.name}:{request_id}"
