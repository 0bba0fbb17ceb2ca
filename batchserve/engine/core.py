"""The batching engine: admission, queue, scheduler, devices, capacity and drain; no HTTP.

    async with Engine(config, fn_per_device=load, devices="cpu") as engine:
        result = await engine.infer(Ask("some input", timeout_ms=2000))
        ticket = engine.submit("later")       # poll ticket.status, or await ticket

The HTTP server, the status API and the dashboard are doors onto one engine; a Python
program embeds it the same way. The engine owns its parts and starts and stops them in one
place (the pool first in, last out); each job is a module of its own beside this one:
admission for both schedulers (`intake.py`), the generation request path (`generating.py`),
the versions changed while serving (`versions.py`), drain and crash (`drain.py`), the
read-only views (`views.py`, as `engine.view`) and the access record (`recorder.py`).
Everything reads time from one injected clock. Its tasks are supervised: if one crashes,
the engine fails what it holds, turns not-ready and sets `failed`, which makes the server
exit non-zero rather than serve into a dead batcher.

What stays here, and why this module is a little over the house's ~400 lines: the owner's
construction and lifecycle, a live reconfigure (it touches every part), and the batch
request path (`infer`, `admit`, `_queue`, `settle`), kept inline because each further call
is paid by every request (benchmarks/README.md, section 4); the rest are one-line
hand-offs that the documented library API names (docs/operating.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..batcher import Batcher
from ..batching.deadlines import Deadlines
from ..batching.lanes import length_bucket
from ..batching.request import Ask, QueuedRequest, Result, Ticket, new_request_id
from ..clock import Clock, LoopClock, Timer
from ..config import Config
from ..devices.device import Device
from ..devices.fleet import Devices
from ..errors import BatchserveError, ClientClosed
from ..generation.building import build_generation_model
from ..generation.models import Generators
from ..live_config import LiveChanges, live_changes
from ..models.registry import Key, Registry
from ..models.specs import BatchFn, DeviceFactory, ModelSpec
from ..observability.metrics import BatchTimes, Metrics
from ..observability.tracing import Tracer, global_provider
from ..rules.admission import Admission
from ..rules.policy import Policy
from ..rules.tenants import Tenant
from .counting import Counted, Counting, worth_a_thread
from .drain import Drain
from .generating import GenerationPath
from .intake import Intake, Phase, in_flight
from .list_answers import all_answers
from .recorder import Recorder
from .requests import Caller
from .versions import Versions, starting_models
from .views import EngineStats, EngineView

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

_ANONYMOUS = Caller()


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
        versions, generating = starting_models(
            config, models, fn=fn, fn_per_device=fn_per_device, devices=devices, policy=policy
        )
        self._registry = Registry(versions)
        self._tracer = (
            Tracer(tracer_provider or global_provider(), self.clock) if config.trace else None
        )
        self._devices = Devices(clock=self.clock, on_crash=self._crashed, changed=self._changed)
        """Every device, one runner each, shared by the pool and the generation models."""
        self._generators = Generators(
            [
                build_generation_model(
                    config, spec, clock=self.clock, on_crash=self._crashed, devices=self._devices
                )
                for spec in generating
            ]
        )
        self.started = asyncio.Event()
        """Set once every device has loaded and the engine takes requests."""
        self._deadlines = Deadlines(self.clock)
        times = BatchTimes() if config.metrics else None
        self._batcher = Batcher(
            versions,
            config,
            devices=self._devices,
            clock=self.clock,
            on_crash=self._crashed,
            on_call=None if self._tracer is None else self._tracer.batch_call,
            on_batch_ran=None if times is None else times.ran,
        )
        self._pool = self._batcher.pool
        self.device_names = [device.name for device in self._pool.devices]
        self.metrics = None if times is None else Metrics(
            times, self._batcher, self._pool, self._registry, self._generators,
            clock=self.clock, slo_s=config.slo_ms / 1e3,
        )  # fmt: skip
        self._recorder = Recorder(self.metrics, config.access_log)
        self._intake = Intake(
            config, self._registry, self._generators, self._pool, self._batcher.capacity_rps
        )
        # The batch scheduler's routing, bound once: `admit` runs for every request.
        self._batch_route = self._intake.batch_version
        self.generation = GenerationPath(
            self.clock,
            self._intake,
            self._generators,
            self._recorder,
            self._tracer,
            tenants_share_prefixes=config.prefix_cache_shared,
        )
        """The generation request path (generating.py)."""
        self.generate = self.generation.generate
        """`async with engine.generate(prompt, ...) as gen:` one generation; see
        GenerationPath.generate."""
        self.view = EngineView(
            self._intake, self._registry, self._generators, self._pool, self._batcher
        )
        """The read-only views, for doors, operators and tests (views.py)."""
        self._counting = Counting(self._registry)
        """Long lists' tokens, counted off the loop (counting.py)."""
        self._drain = Drain(
            self.clock,
            self._intake,
            self._batcher,
            self._pool,
            self._generators,
            self.generation.idle,
            self._counting.idle,
        )
        self.failed = self._drain.failed
        """Set when one of the engine's tasks crashed; `failure` says which and why."""
        self._stack = contextlib.AsyncExitStack()
        self.versions = Versions(
            self._registry,
            self._pool,
            self._batcher,
            self.metrics,
            require_ready=self._intake.require_ready,
            on_crash=self._crashed,
        )
        """The batch model versions added, reweighted and removed while serving (the admin
        API; versions.py)."""

    def __repr__(self) -> str:
        return f"<Engine {self._intake!r} {self._pool!r}>"

    async def __aenter__(self) -> Engine:
        """Loads every device, then starts the batcher; ready once both are up."""
        if isinstance(self.clock, LoopClock):
            self.clock.attach(asyncio.get_running_loop())
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self._devices)
            await stack.enter_async_context(self._batcher)  # the pool first, then its loop
            await stack.enter_async_context(self._generators)
            self._stack = stack.pop_all()
        self.versions.all_ready()
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
            self._counting.close()
        await self.versions.aclose()
        await self._stack.aclose()

    # Requests

    async def infer(self, ask: Ask | str, caller: Caller | None = None) -> Result:
        """Runs one input in a batch and returns its result; errors are `errors.py`'s.

        `ask.model` may be left out when the engine runs one; `ask.version` pins one of its
        versions (else they share traffic by weight); `ask.params` go to the batch function
        as keyword arguments; `ask.timeout_ms` may only lower the server's `timeout_ms` (and
        the tenant's tier deadline). `caller`: who sent it, when, through which door
        (requests.py); a bare string is `Ask(text)` from an unnamed caller.
        """
        ask = Ask(ask) if isinstance(ask, str) else ask
        caller = caller or _ANONYMOUS
        route = caller.route or "inference"
        tenant = caller.tenant
        request, expiry = self.admit(route, ask, caller.request_id, tenant, caller.arrival)
        del ask, caller  # each object a waiting request keeps costs the loop (section 4)
        return await self._answer(route, request, expiry, tenant)

    async def _answer(
        self, route: str, request: QueuedRequest, expiry: Timer | None, tenant: Tenant | None
    ) -> Result:
        """An admitted request's result, once it is answered; `settle`d whatever ends it."""
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
        asks: Sequence[Ask],
        caller: Caller | None = None,
        check: Callable[[], None] | None = None,
    ) -> list[Result]:
        """Runs each of `asks` as one request of `infer`, batched with everyone else's
        (perhaps in different batches); returns their results in the order given, or raises
        the error of the first input (by position) that failed, once all are done. Several
        inputs are parts of one request, with ids `<request_id>.<index>`, kept apart from
        every id a client sends. `check`: the caller's check of the inputs (against the
        model's length), run before any is admitted; what it raises is the list's refusal.

        All or nothing: the list spends its tenant's tokens at once, and every input is
        admitted in one pass before any batch can form, so a refusal of any input withdraws
        the others before they reach a device. A long list's check and tokens are counted
        off the loop before that pass (counting.py), once its tenant's rate is spent."""
        caller = caller or _ANONYMOUS
        route, tenant = caller.route or "inference", caller.tenant
        arrival = self.clock.time() if caller.arrival is None else caller.arrival
        request_id = caller.request_id or new_request_id()
        several = len(asks) > 1
        ids = [f"{request_id}.{index}" for index in range(len(asks))] if several else [request_id]
        texts = [ask.text for ask in asks]
        counted: list[Counted] | None = None
        spends = len(asks)
        try:
            if worth_a_thread(texts):
                self._intake.spend(tenant, arrival, spends)
                spends = 0
                self._intake.check_phase()  # nothing is counted that would be refused
                model, version = (asks[0].model, asks[0].version) if asks else (None, None)
                counted = await self._counting.count(texts, ids, model, version, check)
            elif check is not None:
                check()
        except BatchserveError as refusal:
            self.record(route, request_id, arrival, refusal, tenant)
            raise
        admitted: list[tuple[QueuedRequest, Timer | None]] = []
        try:
            for index, ask in enumerate(asks):
                counts = None if counted is None else counted[index]
                admitted.append(self.admit(
                    route, ask, ids[index], tenant, arrival, several, spends if index == 0 else 0,
                    counts,
                ))  # fmt: skip
        except BatchserveError as refusal:
            for request, expiry in admitted:  # answered with the list's refusal
                self.settle(route, request, expiry, tenant, refusal)
            raise
        return await all_answers(
            admitted,
            lambda request, expiry, outcome: self.settle(route, request, expiry, tenant, outcome),
        )

    def submit(self, ask: Ask | str, caller: Caller | None = None) -> Ticket:
        """Queues one input and returns at once: the ticket tells its status and, awaited,
        gives its result. It runs exactly like `infer` (same queue, deadline, faults)."""
        ask = Ask(ask) if isinstance(ask, str) else ask
        caller = caller or _ANONYMOUS
        route, tenant = caller.route or "requests", caller.tenant
        request, expiry = self.admit(route, ask, caller.request_id, tenant, caller.arrival)
        ticket = Ticket(request)
        done = functools.partial(self._submitted_done, route, request, expiry, tenant)
        ticket.add_done_callback(done)
        return ticket

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
        spends: int = 1,
        counted: Counted | None = None,
    ) -> tuple[QueuedRequest, Timer | None]:
        """Queues the request and arms its deadline (the timer to cancel, if it has one of
        its own); a refusal is recorded under `route` and raised. `spends`: what it spends
        of its tenant's rate (intake.py); `counted`: its tokens, counted off the loop.

        `infer` in parts, for a door that awaits the request's future itself and then hands
        its outcome to `settle`: `infer`'s coroutine would be one more object each waiting
        request keeps (benchmarks/README.md, section 4)."""
        arrival = self.clock.time() if arrival is None else arrival
        request_id = request_id or new_request_id()
        try:
            return self._queue(ask, request_id, tenant, arrival, part, spends, counted)
        except BatchserveError as error:
            self.record(route, request_id, arrival, error, tenant)
            raise

    def _queue(
        self,
        ask: Ask,
        request_id: str,
        tenant: Tenant | None,
        arrival: float,
        part: bool,
        spends: int,
        counted: Counted | None = None,
    ) -> tuple[QueuedRequest, Timer | None]:
        """Admits the request (intake.py), then queues it and arms its deadline."""
        text = ask.text
        version, deadline, flight_key = self._intake.admit(
            self._batch_route, ask.model, ask.version, text, ask.timeout_ms,
            request_id, tenant, arrival, part, spends=spends,
        )  # fmt: skip
        params_key = version.params_key(ask.params) if ask.params is not None else b""
        if version.spec.cost == "length":
            # Counted off the loop by the version it was routed to then, unless rerouted.
            known = counted is not None and counted[0] is version
            tokens = max(1, counted[1] if known else version.tokens(text))  # type: ignore[index]
            key = Key(version, params_key, length_bucket(version, tokens), ask.params or None)
        else:
            tokens = 1
            key = Key(version, params_key, 0, ask.params) if params_key else version.plain_key
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        request = QueuedRequest(request_id, text, arrival, deadline, future, key, tokens)
        if tenant is not None:
            request.tenant, request.tier_rank = tenant.name, tenant.rank
            request.tenant_weight = tenant.weight
        request.part = part
        # Pending before the batcher hears of it: whoever waits on the state it announces
        # (draining, `wait_until`) sees this request counted.
        self._intake.pending[flight_key] = request
        try:
            self._batcher.submit(request)
        except BaseException:
            del self._intake.pending[flight_key]
            raise
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
        with nothing answered (a client that went away), recorded as 499 like a generation
        whose client left. Still queued (a timeout, a disconnect), it leaves the queue
        before any batch is formed."""
        if expiry is not None:
            expiry.cancel()
        del self._intake.pending[in_flight(tenant, request.request_id, request.part)]
        self._batcher.discard(request)
        if outcome is None:
            outcome = ClientClosed("the client left before its answer")
        if self._tracer is not None:
            self._tracer.request(route, request, outcome)
        self.record(route, request.request_id, request.arrival, outcome, tenant)

    def _submitted_done(
        self,
        route: str,
        request: QueuedRequest,
        expiry: Timer | None,
        tenant: Tenant | None,
        ticket: Ticket,
    ) -> None:
        self.settle(route, request, expiry, tenant, ticket.outcome())

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
        models = self.versions.plan(config)
        self.config = config
        self._intake.configure(admission, config)
        self._batcher.max_queue = config.max_queue
        self._batcher.idle.call_s = config.idle_call_ms / 1000
        self._recorder.access_log_on = config.access_log
        self.versions.apply(models, config)
        return LiveChanges(config, changes.changed, [*changes.kept, *models.kept])

    # Lifecycle

    async def drain(self, *, refuse_new: bool = True) -> None:
        """Turns readiness off, stops taking requests and answers every accepted one; safe
        to call twice. What has not run `drain_timeout_s` after the drain began is answered
        503 (drain.py).

        `refuse_new=False` is for a server that has already closed its doors (listeners
        closed, each connection closing after the request in hand): what still arrives was
        sent before the drain began, at most one request per connection, and is served
        rather than answered 503 (nginx does not retry a 503)."""
        await self._drain.drain(self.config.drain_timeout_s, refuse_new=refuse_new)

    # The parts are built with these callbacks before what handles them: the Drain, and the
    # pool (the devices are shared with the generation models, so come first).

    def _crashed(self, task_name: str, error: BaseException) -> None:
        self._drain.crashed(task_name, error)

    def _changed(self, device: Device) -> None:
        self._pool.device_changed(device)

    @property
    def failure(self) -> str | None:
        """Which task crashed and why, once `failed` is set."""
        return self._drain.failure

    # The read-only views that the library API documents (docs/operating.md); the rest
    # are on `engine.view` (views.py).

    def readiness(self) -> tuple[bool, str]:
        return self.view.readiness()

    def device_states(self) -> dict[str, str]:
        return self.view.device_states()

    def stats(self) -> EngineStats:
        return self.view.stats()

    @property
    def faults(self) -> Counter[str]:
        return self.view.faults

    @property
    def recoveries(self) -> Counter[str]:
        return self.view.recoveries
