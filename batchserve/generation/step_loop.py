"""Iteration-level (continuous) batching: one scheduler per device of a generation model.

Before each step a device drops the sequences that ended or whose waiter left (releasing
them in the model), then admits waiting ones while they fit its KV budget as they stand now
(prompt + tokens so far + 1). With a generator that caches prefixes (`PrefixCache`) a
sequence counts only what its device's cache does not hold yet: admitting it attaches it to
its cached prefix, its prefill starts after it, and the budget counts the rows the device
holds (a shared row once) plus what each running sequence still needs; one whose next block
another running sequence is computing waits for it, so a prefix is computed once.

Admission is optimistic: sequences grow a token a step, and when the running ones no longer
fit, the newest is preempted (released, and put back at the head of the line with its tokens,
to be recomputed when it runs again: from its cached blocks, where they are still cached). A
sequence alone always fits, since a prompt whose tokens plus `max_tokens` exceed the budget
(or the context length) is refused at once (413). Steps then run back to back while any
sequence runs.

Admission is first fit: a sequence that does not fit (a long prompt, or a preempted sequence
with its tokens) keeps its place at the head of the line, and the ones behind it that fit go
ahead, so a short prompt does not wait for room it does not need. It can be passed only
`PASS_LIMIT` times; after that the line waits for it, so short prompts never starve a long one.

`static` mode is the baseline the benchmark compares against: a batch forms only when the
device is empty, reserving prompt + `max_tokens` for each sequence so none is ever
preempted, and nothing joins it until its longest sequence ends.

A step that raises is retried in halves, each half released first so the model recomputes
it, until only the sequences that make it fail are failed (500), as batches are bisected.

A generator that prefills in chunks (`chunked_prefill`) is handed at most `step_tokens`
tokens a step: every decoding sequence's one token first, then what is left shared fairly
between the prompts still prefilling (`rules/prefill.py`: by tenant, then by prompt), so
running streams keep making a token a step while a long prompt comes in, and short prompts
finish their prefill beside it instead of after it. The steps that carry prefill measure the
device's prefill cost, from which the model predicts a new request's first token.

A step that runs past its budget (`--batch-timeout-ms`, or 5x the step's predicted time,
`a + b x tokens` learned from the steps before it over the tokens it processes, and past the
largest step seen no less than that step's time scaled by the tokens; at least 1 s)
without progress hangs its device: its sequences go back to the head of the line with their
tokens, for another device to recompute and go on with (500 where no other device can), and
the device takes nothing new until the step returns; what it returns then is dropped, and the
sequences it held are released on it. A release (of ended or preempted sequences) runs under
the same watchdog: one that hangs hands the running sequences on in the same way.

The watchdog judges the device by its thread, not by when the loop got round to looking:
when the budget is up it is not hung if its thread has already returned the call (the loop
was stalled: tokenizing, a slow handler), nor if the generator's `progress` counter (bumped
as it works, e.g. once a layer) moved in the last budget: a busy machine's slow step gets
another budget, as many as it keeps advancing. Only a call that made no progress for a whole
budget is hung; with one device that fails its streams, the last resort.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from ..clock import Clock, Timer
from ..config import GenerateMode
from ..devices.thread import DeviceThread
from ..errors import BackendError
from ..models.generators import (
    CachedPrefix,
    Generator,
    GeneratorFactory,
    PrefixCache,
    StepAnswer,
    check_step,
)
from ..rules.capacity import BatchBudget, DecayedRate, PrefillCost, StepCost
from ..rules.prefill import fair_split
from .request import Generation, GenState

log = logging.getLogger(__name__)
Arg = TypeVar("Arg")
Ret = TypeVar("Ret")

PASS_LIMIT = 64
"""Sequences that may be admitted past one waiting for room, before the line waits for it."""
PASS_DEPTH = 16
"""How many sequences that do not fit admission looks past, so a long line costs no more."""


class _Hung(Exception):
    """The call (a step or a release) ran past its budget; its sequences were already
    handed back."""


class LineOwner(Protocol):
    """What a `StepLoop` needs of the generation model it runs for (generation/models.py,
    which imports this module): its one line of sequences, and the counters it adds to."""

    token_rate: DecayedRate
    steps: int
    preemptions: int
    step_failures: int
    hung_steps: int
    prefix_queries: int
    prefix_hits: int
    prefill_tokens: int

    @property
    def max_batch_size(self) -> int: ...

    async def wait_for_work(self) -> None: ...

    def take(self) -> Generation | None:
        """The next sequence in line that still wants to run."""

    def put_back(self, gen: Generation) -> None:
        """To the head of the line (preempted, or too big for this device now)."""

    def hand_back(self, gens: list[Generation], call: str, budget_s: float, now: float) -> None:
        """The sequences of a device whose `call` hung: on to another device, or failed."""


class StepLoop:
    """One device: its thread, its generator and the sequences running on it."""

    def __init__(
        self,
        device: str,
        model: LineOwner,
        clock: Clock,
        budget: BatchBudget,
        step_tokens: int,
    ) -> None:
        self.device = device
        self._model = model
        self._clock = clock
        self._budget = budget
        self._step_tokens = step_tokens
        self._chunked = False
        """The generator prefills in chunks of `step_tokens` (it said `chunked_prefill`)."""
        self.step_cost = StepCost()
        """A step's seconds over the tokens it processes: its hang budget's prediction."""
        self.prefill_cost = PrefillCost()
        """The time of the steps that carry prefill: the first-token forecast's."""
        self.hung = False
        """A step ran past its budget and has not returned yet."""
        self._thread = DeviceThread(device)
        self._generator: Generator | None = None
        self._cache: PrefixCache | None = None
        """The generator, if it caches prefixes (and prefills in chunks, to start after them)."""
        self._rows_held = 0
        """The cache's rows held by some sequence, read between steps."""
        self.running: list[Generation] = []
        """In the order they were admitted: the newest is preempted first."""
        self._to_release: list[str] = []
        self._watchdog: Timer | None = None
        """The running call's: it looks at the device when the call's budget is up."""

    def __repr__(self) -> str:
        return f"<StepLoop {self.device} running={len(self.running)}>"

    @property
    def kv_budget(self) -> int:
        return 0 if self._generator is None else self._generator.kv_budget_tokens

    @property
    def max_seq_tokens(self) -> int:
        """What one sequence may hold: the context length where the generator says it."""
        return self.kv_budget if self._cache is None else self._cache.max_seq_tokens

    @property
    def kv_used(self) -> int:
        """The budget the running sequences take: what each holds after its next step, or
        (prefix caching) the rows held, a shared one once, plus what each still needs."""
        if self._cache is None:
            return sum(gen.held_tokens for gen in self.running)
        return self._rows_held + sum(gen.held_tokens - gen.computed for gen in self.running)

    @property
    def chunked(self) -> bool:
        return self._chunked

    def prefill_seconds(self, tokens: int, *, alone: bool = False) -> float | None:
        """How long this device takes to prefill `tokens` beside its decoding sequences (or
        `alone`): in full steps, each leaving its decodes their token, or (whole prompts a
        step) in one; None before it has measured its steps."""
        decoding = 0 if alone else sum(1 for gen in self.running if gen.prefill_tokens == 0)
        per_step = max(1, self._step_tokens - decoding)
        if not self._chunked or tokens <= per_step:
            return self.prefill_cost.step_seconds(tokens + decoding)
        full = self.prefill_cost.step_seconds(self._step_tokens)
        return None if full is None else tokens / per_step * full

    async def load(self, factory: GeneratorFactory) -> Generator:
        """Starts the device's thread and loads the generator on it."""
        self._thread.start(asyncio.get_running_loop())
        self._generator = await self._thread.submit(factory, self.device)
        self._chunked = getattr(self._generator, "chunked_prefill", False) is True
        if self._chunked and isinstance(self._generator, PrefixCache):
            self._cache = self._generator
        return self._generator

    async def stop(self, wait_s: float) -> None:
        """Ends the device's thread, waiting up to `wait_s` for a call still inside the model
        (a process that exits under a thread inside torch aborts)."""
        self._thread.stop()
        await self._thread.join(wait_s)

    async def run(self, mode: GenerateMode) -> None:
        """Steps back to back while anything runs; sleeps until work arrives otherwise."""
        while True:
            self._sweep()
            if self._to_release:  # first, so that their rows count no more
                released, self._to_release = self._to_release, []
                await self._release(released)
            if mode == "continuous" or not self.running:
                self._admit(reserve=mode == "static")
            self._preempt_over_budget()
            if self._to_release:
                released, self._to_release = self._to_release, []
                await self._release(released)
            if not self.running:
                await self._model.wait_for_work()
                continue
            made = await self._step(self._plan())
            now = self._clock.time()
            for gen, token in made:
                if not gen.cancelled and not gen.done:
                    gen.add(token, now)
            self._model.token_rate.add(now, len(made))

    def _sweep(self) -> None:
        """Drops what ended or was cancelled; their state is released before the next step."""
        kept: list[Generation] = []
        for gen in self.running:
            if gen.done or gen.cancelled:
                self._to_release.append(gen.seq.id)
            else:
                kept.append(gen)
        self.running = kept

    def _plan(self) -> list[Generation]:
        """The sequences this step takes, each with its `seq.chunk`: all of them, or (chunked)
        every decoding one first, then the prefills' fair shares of what the budget leaves."""
        if not self._chunked:
            for gen in self.running:
                gen.seq.chunk = None
            return list(self.running)
        decoding = [gen for gen in self.running if gen.prefill_tokens == 0]
        for gen in decoding:
            gen.seq.chunk = 1
        prefilling = [gen for gen in self.running if gen.prefill_tokens > 0]
        chunks = fair_split(self._step_tokens - len(decoding), [g.prefill() for g in prefilling])
        for gen, chunk in zip(prefilling, chunks, strict=True):
            gen.seq.chunk = chunk
        return decoding + [gen for gen, chunk in zip(prefilling, chunks, strict=True) if chunk]

    def _admit(self, *, reserve: bool) -> None:
        """Takes waiting sequences, in the queue's order, while they fit the budget as they
        stand now, passing over those that do not (first fit); or (`reserve`, static mode)
        strictly in order, each with room for all its `max_tokens`."""
        budget = self.kv_budget
        used = sum(self._need(gen, True) for gen in self.running) if reserve else self.kv_used
        limit = self._model.max_batch_size if reserve else None
        passed: list[Generation] = []
        while limit is None or len(self.running) < limit:
            gen = self._model.take()
            if gen is None:
                break
            cached = self._cached_prefix(gen)
            need = self._need(gen, reserve) - cached.tokens + cached.idle
            if (cached.expected and not reserve) or used + need > budget:
                passed.append(gen)
                if reserve or gen.times_passed >= PASS_LIMIT or len(passed) == PASS_DEPTH:
                    break
                continue
            used += need
            self._attach(gen)
            gen.state, gen.device = GenState.RUNNING, self.device
            self.running.append(gen)
            for waiting in passed:
                waiting.times_passed += 1
            if any(waiting.times_passed >= PASS_LIMIT for waiting in passed):
                break
        for gen in reversed(passed):  # back in their places, at the head of the line
            self._model.put_back(gen)

    @staticmethod
    def _need(gen: Generation, reserve: bool) -> int:
        return gen.prompt_tokens + gen.max_tokens if reserve else gen.held_tokens

    @property
    def caches_prefixes(self) -> bool:
        return self._cache is not None

    def cached_tokens(self, gen: Generation) -> int:
        """How much of `gen`'s prompt this device's cache holds now: lookups in the cache,
        which a step running beside them cannot spoil (on the loop, or the model's
        tokenizer thread for a long prompt)."""
        return self._cached_prefix(gen).tokens

    def _cached_prefix(self, gen: Generation) -> CachedPrefix:
        return CachedPrefix() if self._cache is None else self._cache.cached_prefix(gen.seq)

    def _attach(self, gen: Generation) -> None:
        """Admitted: it takes its cached prefix, and its prefill starts after it."""
        if self._cache is None:
            return
        gen.computed = self._cache.attach(gen.seq)
        self._rows_held = self._cache.kv_rows_held
        if gen.first_token_at is None:
            gen.cached_tokens = min(gen.computed, gen.prompt_tokens)
        self._model.prefix_queries += gen.prompt_tokens + len(gen.seq.tokens)
        self._model.prefix_hits += gen.computed

    def _preempt_over_budget(self) -> None:
        """Grown past the budget: the newest sequences go back to the head of the line."""
        used = self.kv_used  # summed once, not once for each sequence put back
        while len(self.running) > 1 and used > self.kv_budget:
            gen = self.running.pop()
            own = gen.computed if self._cache is None else self._cache.own_rows(gen.seq.id)
            used -= gen.held_tokens - gen.computed + own
            gen.state = GenState.WAITING
            gen.computed = 0
            gen.preemptions += 1
            self._model.preemptions += 1
            self._to_release.append(gen.seq.id)
            self._model.put_back(gen)

    async def _step(self, gens: list[Generation]) -> list[tuple[Generation, StepAnswer]]:
        """One step over `gens`; on a failure, the halves again, down to the culprits."""
        generator = self._generator
        assert generator is not None
        tokens = sum(gen.tokens_this_step for gen in gens)
        prefills = any(gen.prefill_tokens for gen in gens)
        started = self._clock.time()
        try:
            budget_s = self._budget.seconds(self.step_cost.predict(tokens))
            answer = await self._watched(
                generator.step, [gen.seq for gen in gens], "step", budget_s
            )
            self.step_cost.observe(self._clock.time() - started, tokens)
            if prefills:
                self.prefill_cost.observe(self._clock.time() - started, tokens)
            made = check_step(answer, len(gens))
        except _Hung:
            return []
        except Exception as exc:
            self._model.step_failures += 1
            log.warning(
                "%s: a step of %d sequences failed (%s: %s)",
                self.device,
                len(gens),
                type(exc).__name__,
                exc,
            )
            if len(gens) == 1:  # failed: the sweep releases it before the next step
                gens[0].fail(
                    BackendError(f"the generator failed: {type(exc).__name__}: {exc}"),
                    self._clock.time(),
                )
                return []
            for gen in gens:
                gen.computed = 0
            await self._release([gen.seq.id for gen in gens])  # the halves recompute
            half = len(gens) // 2
            first = await self._step(gens[:half])
            if not self.running:  # handed back: the first half's step hung
                return first
            return first + await self._step(gens[half:])
        self._model.steps += 1
        prompts = (gen.tokens_this_step for gen in gens if gen.first_token_at is None)
        self._model.prefill_tokens += sum(prompts)
        for gen in gens:
            gen.computed += gen.tokens_this_step
        if self._cache is not None:
            self._rows_held = self._cache.kv_rows_held
        return list(zip(gens, made, strict=True))

    async def _watched(
        self, call: Callable[[Arg], Ret], arg: Arg, what: str, budget_s: float
    ) -> Ret:
        """`call(arg)` (a step, or a release) on the device's thread, under a watchdog: past
        its budget the running sequences are handed back at once, and this waits for the
        late call."""
        done = self._thread.submit(call, arg)
        self._look_later(self._thread.submitted, self._progress(), budget_s, what)
        try:
            returned = await done
        except Exception:
            if not self.hung:
                raise
        finally:
            assert self._watchdog is not None
            self._watchdog.cancel()
        if self.hung:  # it returned at last: what it made is dropped
            log.warning("%s: the hung %s returned; its results were discarded", self.device, what)
            self.hung = False
            raise _Hung
        return returned

    def _look_later(self, call: int, seen: int | None, budget_s: float, what: str) -> None:
        when = self._clock.time() + budget_s
        self._watchdog = self._clock.call_at(when, self._look, call, seen, budget_s, what)

    def _look(self, call: int, seen: int | None, budget_s: float, what: str) -> None:
        """The budget of call number `call` is up: hung only if it has not returned and
        made no progress since the last look (`seen`)."""
        if self._thread.returned >= call:
            return  # it came back in time; the loop was late to hear of it
        progress = self._progress()
        if progress != seen:
            self._look_later(call, progress, budget_s, what)  # slow, still advancing
            return
        self._hang(budget_s, what)

    def _progress(self) -> int | None:
        """The generator's work counter, if it keeps one (`Generator.progress`)."""
        progress = getattr(self._generator, "progress", None)
        return progress if isinstance(progress, int) else None

    def _hang(self, budget_s: float, what: str) -> None:
        """The watchdog: the device is hung; its sequences go on elsewhere, or fail."""
        self.hung = True
        self._model.hung_steps += 1
        log.error(
            "%s: a %s ran past its budget of %.0f ms without progress; the device takes no"
            " new sequences until it returns",
            self.device,
            what,
            budget_s * 1e3,
        )
        handed_back, self.running = self.running, []
        for gen in handed_back:
            gen.computed = 0
        self._to_release += [gen.seq.id for gen in handed_back]  # once it is back
        now = self._clock.time()
        self._model.hand_back(handed_back, f"the {what} on {self.device}", budget_s, now)

    async def _release(self, seq_ids: list[str]) -> None:
        """Frees ended or preempted sequences' state on the device, under the same watchdog
        as a step: a release that hangs must not hold the running sequences with it."""
        generator = self._generator
        assert generator is not None
        try:
            budget_s = self._budget.seconds(self.step_cost.predict(0))
            await self._watched(generator.release, seq_ids, "release", budget_s)
            if self._cache is not None:
                self._rows_held = self._cache.kv_rows_held
        except _Hung:
            return  # the running sequences went on elsewhere meanwhile
        except Exception as exc:
            log.error("%s: release failed (%s: %s)", self.device, type(exc).__name__, exc)
