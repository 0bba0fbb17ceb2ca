"""The generation request path: admit a prompt, hand it to its generation model, and release
and record it when its caller is done; no HTTP.

The engine holds one and hands `generate` on (`engine.generate(Prompt(...))`). Admission is the one
of batch requests (`intake.py`); what is particular to generation follows it: the prompt's
tokens against the device's budget (its bytes first, then its tokens, counted on the model's
tokenizer thread: never on the event loop), the sampling parameters' rules, the first-token
deadline, the sequence's prefix-cache key (its tenant's, unless --prefix-cache-shared, and the
request's `cache_salt`: only sequences with the same key share cached KV rows), and cancelling
a sequence whose caller left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..batching.request import new_request_id
from ..clock import Clock
from ..errors import BatchserveError, DuplicateRequestId, InvalidInput
from ..generation.models import GenerationModel, Generators
from ..generation.request import Generation
from ..models.generators import Seq
from ..observability.tracing import Tracer
from ..rules.admission import stop_strings
from ..rules.prefill import refuse_if_late
from ..rules.sampling_params import LOGPROBS, checked_params
from ..rules.tenants import IDLE_RANK, Tenant
from .intake import InFlightKey, Intake
from .recorder import Recorder
from .requests import Caller, Prompt


class GenerationPath:
    def __init__(
        self,
        clock: Clock,
        intake: Intake,
        generators: Generators,
        recorder: Recorder,
        tracer: Tracer | None,
        *,
        tenants_share_prefixes: bool = False,
    ) -> None:
        self._clock = clock
        self._intake = intake
        self._generators = generators
        self._recorder = recorder
        self._tracer = tracer
        self._route = intake.generation_model
        self._tenants_share_prefixes = tenants_share_prefixes
        self.idle = asyncio.Event()
        """Set while no generation is in flight or being admitted: what a drain waits for."""
        self.idle.set()
        self._admitting = 0
        """Generations between admission and their line: their prompts being tokenized."""

    @contextlib.asynccontextmanager
    async def generate(
        self, prompt: Prompt | str, caller: Caller | None = None
    ) -> AsyncIterator[Generation]:
        """Starts one generation; read its text as it comes with `gen.pieces()`, or whole
        with `await gen.result()`:

            async with engine.generate(Prompt("Once upon", max_tokens=50)) as gen:
                async for piece in gen.pieces():
                    print(piece, end="")

        A refusal raises on entry (`errors.py`'s, like `infer`'s), among them `params` that
        break `rules/sampling_params.py`'s rules, so the generator never sees them.
        `prompt.timeout_ms` bounds the wait for the first token; the sequence then runs to
        its end. Leaving the block before it ends cancels it: its sequence is released
        before the next step. `caller`: who sent it (requests.py); a bare string is
        `Prompt(text)`.
        `prompt.constraint`: a grammar the output keeps to, compiled (or found compiled) before
        the sequence is queued; one that does not compile is refused (InvalidInput).
        """
        prompt = Prompt(prompt) if isinstance(prompt, str) else prompt
        caller = caller or Caller()
        route, tenant = caller.route or "generate", caller.tenant
        arrival = self._clock.time() if caller.arrival is None else caller.arrival
        request_id = caller.request_id or new_request_id()
        self._admitting += 1  # a drain waits for it while its prompt is tokenized
        self.idle.clear()
        try:
            generation_model, gen, in_flight = await self._admit(
                prompt, request_id, tenant, arrival
            )
            if prompt.fork_of is not None:
                gen.seq.fork_of = _seq_id(tenant, prompt.fork_of)
            self._intake.generating[in_flight] = gen
        except BatchserveError as error:
            now = self._clock.time()
            self._recorder.record(route, request_id, tenant, now - arrival, error, now)
            raise
        finally:
            self._admitting -= 1
            self._settle()
        generation_model.submit(gen)
        expiry = self._clock.call_at(gen.deadline, self._expire, generation_model, gen)
        try:
            yield gen
        finally:
            expiry.cancel()
            if not gen.done:
                gen.cancel()
                generation_model.discard(gen)
            del self._intake.generating[in_flight]
            self._settle()
            now = self._clock.time()
            self._recorder.record_generation(route, tenant, gen, now)
            if self._tracer is not None:
                self._tracer.generation(route, gen)

    def _settle(self) -> None:
        if not self._intake.generating and not self._admitting:
            self.idle.set()

    async def _admit(
        self, prompt: Prompt, request_id: str, tenant: Tenant | None, arrival: float
    ) -> tuple[GenerationModel, Generation, InFlightKey]:
        """Admits a generation as the engine admits a batch request (intake.py), then checks
        its tokens: a prompt that can never fit a device's budget is refused at once (413),
        and one whose first token is predicted past its deadline (503, or 504 where its own
        prefill alone cannot make it: rules/prefill.py); by its bytes before the tokenizer
        runs where they say so, then by its tokens, counted off the event loop."""
        text = prompt.text
        stops = stop_strings(prompt.stop)
        if stops and prompt.constraint is not None:
            raise InvalidInput(
                f'"stop" cannot be combined with "{prompt.constraint.field}": the grammar'
                " decides where the answer ends, and a stop string would cut it where it is"
                " not valid"
            )
        generation_model, deadline, in_flight = self._intake.admit(
            self._route, prompt.model, prompt.version, text, prompt.timeout_ms, request_id,
            tenant, arrival, first_token=True,
        )  # fmt: skip
        # An idle device waits for it to join the line; never for a Batch API line's.
        online = tenant is None or tenant.rank != IDLE_RANK
        with generation_model.admitting() if online else contextlib.nullcontext():
            gen = await self._prepared(
                generation_model, prompt, stops, request_id, tenant, arrival, deadline, in_flight
            )
        return generation_model, gen, in_flight

    async def _prepared(
        self,
        generation_model: GenerationModel,
        prompt: Prompt,
        stops: tuple[str, ...],
        request_id: str,
        tenant: Tenant | None,
        arrival: float,
        deadline: float,
        in_flight: InFlightKey,
    ) -> Generation:
        """The admitted prompt's generation: its tokens counted and checked against the
        budget, its params and grammar, its cached prefix, its first-token forecast."""
        text, max_tokens = prompt.text, prompt.max_tokens
        rules = self._intake.rules
        budget = generation_model.kv_budget
        params, prompt_ids = prompt.params, prompt.prompt_ids
        check_reported(generation_model, params, prompt_ids)
        # The prompt's log-probabilities alone (echo) make no token.
        least = 0 if (params or {}).get("prompt_logprobs") is not None else 1
        if prompt_ids is None:
            most_bytes = generation_model.max_token_bytes
            rules.check_prompt_bytes(text, most_bytes, max_tokens, budget, least=least)
            prompt_tokens = await generation_model.prompt_tokens(text)
        else:
            prompt_tokens = len(prompt_ids)
        if in_flight in self._intake.generating:  # admitted beside it while it was tokenized
            raise DuplicateRequestId(f"request id {request_id} is already in flight")
        limit = rules.new_tokens(prompt_tokens, max_tokens, budget, least=least)
        sampling = checked_params(params, limit)
        grammars = generation_model.grammars
        grammar = None if prompt.constraint is None else await grammars.compiled(*prompt.constraint)
        gen = Generation(
            # The sequence's id is the generator's handle, unique across tenants.
            Seq(_seq_id(tenant, request_id), text, params=sampling, prompt_ids=prompt_ids),
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            max_tokens=limit,
            stops=stops,
            arrival=arrival,
            deadline=deadline,
            model=generation_model.spec.name,
            version=generation_model.spec.version,
        )
        if tenant is not None:
            gen.tenant, gen.tier_rank = tenant.name, tenant.rank
            gen.tenant_weight = tenant.weight
        gen.seq.grammar = grammar
        gen.seq.cache_key = self._cache_key(tenant, prompt.cache_salt)  # before the cache is asked
        await generation_model.note_cached_prefix(gen)
        if in_flight in self._intake.generating:  # admitted beside it meanwhile
            raise DuplicateRequestId(f"request id {request_id} is already in flight")
        forecast = generation_model.first_token_forecast(gen)
        if forecast is not None:
            left_s = deadline - self._clock.time()
            refuse_if_late(*forecast, deadline_s=left_s, tokens=gen.prefill_tokens)
        return gen

    def _cache_key(self, tenant: Tenant | None, cache_salt: str | None) -> str:
        """Whose cached prefixes the sequence may share: its tenant's (a shared cache would
        let one tenant time another's prompts) unless the operator shares them, and only
        those of requests with the same `cache_salt`."""
        owner = "" if tenant is None or self._tenants_share_prefixes else tenant.name
        salt = "" if cache_salt is None else cache_salt
        return f"{len(owner)}:{owner}:{salt}"

    def chat_prompt(
        self,
        model: str | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """A chat's messages (and tools) as one prompt, in the template of `model`'s
        generator (`chat_tools.py` where it has no tools section)."""
        return self._generators.route(model, None, "").chat_prompt(messages, tools)

    def _expire(self, generation_model: GenerationModel, gen: Generation) -> None:
        gen.expire(self._clock.time())
        if gen.cancelled:
            generation_model.discard(gen)


def check_reported(
    generation_model: GenerationModel,
    params: Mapping[str, Any] | None,
    prompt_ids: list[int] | None,
) -> None:
    """Refuses what the model's generator cannot do: log-probabilities, a prompt of token
    ids (each below its vocabulary's size), before any device sees it."""
    name = generation_model.spec.name
    asked = [key for key in LOGPROBS if (params or {}).get(key) is not None]
    if asked and not generation_model.reports_logprobs:
        raise InvalidInput(f'"{asked[0]}": model {name} does not report log probabilities')
    if prompt_ids is None:
        return
    vocab = generation_model.vocab_size
    if vocab is None:
        raise InvalidInput(f"model {name} takes text prompts only, not token ids")
    if not prompt_ids:
        raise InvalidInput("a prompt of token ids needs at least one id")
    bad = next((i for i in prompt_ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise InvalidInput(f"token id {bad} is not in model {name}'s vocabulary (0 to {vocab - 1})")


def _seq_id(tenant: Tenant | None, request_id: str) -> str:
    """A generation's id for its generator: the request's, made unique across tenants."""
    if tenant is None:
        return request_id
    scope = tenant.id_scope
    return f"{len(scope)}:{scope}:{request_id}"
