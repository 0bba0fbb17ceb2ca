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
to be recomputed when it runs again: from its cached blocks, where they are still cached); a
Batch API line's sequence goes first, and makes room for online prompts (`kv_room.py`). A
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
finish their prefill beside it instead of after it. While no sequence decodes, a step takes
up to the larger `prefill_step_tokens`: no stream waits on it, and a larger step prefills
faster a token (a burst of chats sharing a system prompt: the prompt in one step, then all
their turns in one). The steps that carry prefill measure the device's prefill cost, from
which the model predicts a new request's first token.

Over 450 lines: admission, preemption, the step's bisection and the hand-back all act on the
one list of running sequences and its budget; what is pure of them is already apart
(`kv_room.py`'s choice of whom to preempt, `rules/prefill.py`'s shares).

Steps and releases are calls on the device's one runner (`devices/fleet.py`), in turn with
any batch model's calls there, under its watchdog and health machine. A call past its budget
(`--batch-timeout-ms`, or 5x the step's predicted time, `a + b x tokens` learned from earlier
steps; at least 1 s) without progress hangs the device: its sequences go back to the head of
the line with their tokens, for another device to go on with (500 where none can), and it
takes nothing until the call returns (dropped) and a probe (a one-token step) answers in time.
Two whole steps failed in a row there alone make it suspect; failing its probe, it restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from ..clock import Clock
from ..config import GenerateMode
from ..devices.device import Device, Probe
from ..devices.fleet import Devices, OutOfService
from ..devices.health import HEALTHY
from ..errors import BackendError
from ..models.generators import (
    CachedPrefix,
    Generator,
    GeneratorFactory,
    PrefixCache,
    Seq,
    StepAnswer,
    check_step,
)
from ..rules.capacity import BatchBudget, DecayedRate, PrefillCost, StepCost
from ..rules.prefill import fair_split
from . import kv_room
from .request import Generation, GenState

log = logging.getLogger(__name__)

PASS_LIMIT = 64
"""Sequences that may be admitted past one waiting for room, before the line waits for it."""
PASS_DEPTH = 16
"""How many sequences that do not fit admission looks past, so a long line costs no more."""
PROBE_ID = "batchserve-probe"


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

    async def wait_for_work(self, device: str) -> None: ...

    def take(self, device: str) -> Generation | None:
        """The next sequence in line that still wants to run on `device`."""

    def put_back(self, gen: Generation) -> None:
        """To the head of the line (preempted, or too big for this device now)."""

    def hand_back(self, gens: list[Generation], error: BackendError, now: float) -> None:
        """The sequences of a device that left service: on to another device, or failed
        with `error`."""


class StepLoop:
    """One generation model on one device: its generator and the sequences running on it;
    its calls go to the device's runner (`Devices`), shared with whoever else is there."""

    def __init__(
        self,
        device: Device,
        devices: Devices,
        model: LineOwner,
        clock: Clock,
        budget: BatchBudget,
        step_tokens: tuple[int, int],
    ) -> None:
        self.device = device.name
        self._device = device
        self._devices = devices
        self._model = model
        self._clock = clock
        self._budget = budget
        self._step_tokens, prefill_step_tokens = step_tokens
        self._prefill_step_tokens = max(self._step_tokens, prefill_step_tokens)
        """A step's tokens at most: while a sequence decodes, and while all prefill."""
        self._chunked = False
        """The generator prefills in chunks (it said `chunked_prefill`)."""
        self.step_cost = StepCost()
        """A step's seconds over the tokens it processes: its hang budget's prediction."""
        self.prefill_cost = PrefillCost()
        """The time of the steps that carry prefill: the first-token forecast's."""
        self._factory: GeneratorFactory | None = None
        self._generator: Generator | None = None
        self._cache: PrefixCache | None = None
        """The generator, if it caches prefixes (and prefills in chunks, to start after them)."""
        self._rows_held = 0
        """The cache's rows held by some sequence, read between steps."""
        self.running: list[Generation] = []
        """In the order they were admitted: the newest is preempted first."""
        self._to_release: list[str] = []

    def __repr__(self) -> str:
        return f"<StepLoop {self.device} running={len(self.running)}>"

    @property
    def in_service(self) -> bool:
        """Its device takes work: not hung, recovering, failing or dead."""
        return self._device.state in HEALTHY

    @property
    def state(self) -> str:
        return self._device.state.value

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
        budget = self._step_limit(decoding)
        per_step = max(1, budget - decoding)
        if not self._chunked or tokens <= per_step:
            return self.prefill_cost.step_seconds(tokens + decoding)
        full = self.prefill_cost.step_seconds(budget)
        return None if full is None else tokens / per_step * full

    def _step_limit(self, decoding: int) -> int:
        """A step's tokens at most, with `decoding` sequences in it."""
        return self._step_tokens if decoding else self._prefill_step_tokens

    async def load(self, factory: GeneratorFactory) -> Generator:
        """Loads the generator on the device's thread (started if it is not yet), where it
        lives: a restart of the device loads it again (`reload`)."""
        self._devices.open(self._device)
        self._factory = factory
        self._device.residents.append(self)
        return await self.reload()

    async def reload(self) -> Generator:
        """Loads the generator on the device's thread: at start, or on a fresh thread after a
        restart (its sequences were handed on; nothing is left to release)."""
        assert self._factory is not None
        self._to_release = []
        generator = await self._device.thread.submit(self._factory, self.device)
        self._generator = generator
        self._chunked = getattr(generator, "chunked_prefill", False) is True
        self._cache = generator if self._chunked and isinstance(generator, PrefixCache) else None
        self._rows_held = 0 if self._cache is None else self._cache.kv_rows_held
        return generator

    def probe(self) -> Probe:
        """A one-token step of an empty prompt, then its release, as the warm-up does."""
        generator = self._generator
        assert generator is not None

        def run(seq: Seq) -> None:
            try:
                check_step(generator.step([seq]), 1)
            finally:
                generator.release([seq.id])

        budget_s = self._budget.seconds(self.step_cost.predict(1))
        return run, Seq(PROBE_ID, "", max_tokens=1), budget_s

    async def run(self, mode: GenerateMode) -> None:
        """Steps back to back while anything runs; sleeps until work arrives, or until its
        device is in service again, otherwise."""
        while True:
            if not self.in_service:
                await self._device.wait_in_service()
            self._sweep()
            if self._to_release:  # first, so that their rows count no more
                released, self._to_release = self._to_release, []
                await self._release(released)
            if mode == "continuous" or not self.running:
                self._admit(reserve=mode == "static")
            if self._to_release:  # batch lines preempted for an online prompt
                released, self._to_release = self._to_release, []
                await self._release(released)
            self._preempt_over_budget()
            if self._to_release:
                released, self._to_release = self._to_release, []
                await self._release(released)
            if not self.running:
                await self._model.wait_for_work(self.device)
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
        every decoding one first, then the prefills' fair shares of what the budget leaves
        (`_step_limit`: larger while none decodes)."""
        if not self._chunked:
            for gen in self.running:
                gen.seq.chunk = None
            return list(self.running)
        decoding = [gen for gen in self.running if gen.prefill_tokens == 0]
        for gen in decoding:
            gen.seq.chunk = 1
        prefilling = [gen for gen in self.running if gen.prefill_tokens > 0]
        budget = self._step_limit(len(decoding)) - len(decoding)
        chunks = fair_split(budget, [g.prefill() for g in prefilling])
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
            gen = self._model.take(self.device)
            if gen is None:
                break
            cached = self._cached_prefix(gen)
            need = self._need(gen, reserve) - cached.tokens + cached.idle
            if not reserve and not cached.expected:  # an online prompt: batch lines yield
                short = used + need - budget
                victims = kv_room.for_online(gen, self.running, short, self._cache)
                used -= sum(map(self._preempt, victims))
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
        """Grown past the budget: sequences go back to the line (`kv_room.over_budget`)."""
        used = self.kv_used  # summed once, not once for each sequence put back
        while len(self.running) > 1 and used > self.kv_budget:
            used -= self._preempt(kv_room.over_budget(self.running))

    def _preempt(self, gen: Generation) -> int:
        """Takes `gen` off the device, to be released, and puts it back in line with its
        tokens; what it frees (`kv_room.frees`)."""
        freed = kv_room.frees(gen, self._cache)
        self.running.remove(gen)
        gen.state = GenState.WAITING
        gen.computed = 0
        gen.preemptions += 1
        self._model.preemptions += 1
        self._to_release.append(gen.seq.id)
        self._model.put_back(gen)
        return freed

    async def _step(
        self, gens: list[Generation], first_try: bool = True
    ) -> list[tuple[Generation, StepAnswer]]:
        """One step over `gens`; on a failure, the halves again, down to the culprits. A
        whole step (`first_try`, not a half) that fails counts against the device."""
        generator = self._generator
        assert generator is not None
        tokens = sum(gen.tokens_this_step for gen in gens)
        prefills = any(gen.prefill_tokens for gen in gens)
        try:
            budget_s = self._budget.seconds(self.step_cost.predict(tokens))
            answer, seconds = await self._devices.call(
                self._device,
                generator.step,
                [gen.seq for gen in gens],
                budget_s,
                self._on_hung("step"),
                progress=self._progress,
                who={(gen.tenant, gen.seq.id, False) for gen in gens},
                first_try=first_try,
            )
            self.step_cost.observe(seconds, tokens)
            if prefills:
                self.prefill_cost.observe(seconds, tokens)
            made = check_step(answer, len(gens))
        except OutOfService:
            self._leave()
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
            first = await self._step(gens[:half], first_try=False)
            if not self.running:  # handed back: the device left service
                return first
            return first + await self._step(gens[half:], first_try=False)
        self._model.steps += 1
        prompts = (gen.tokens_this_step for gen in gens if gen.first_token_at is None)
        self._model.prefill_tokens += sum(prompts)
        for gen in gens:
            gen.computed += gen.tokens_this_step
        if self._cache is not None:
            self._rows_held = self._cache.kv_rows_held
        return list(zip(gens, made, strict=True))

    def _on_hung(self, what: str) -> Callable[[float], None]:
        def hung(budget_s: float) -> None:
            """The watchdog: the device is hung; its sequences go on elsewhere, or fail."""
            self._model.hung_steps += 1
            past = f"the {what} on {self.device} ran past its budget of {budget_s * 1e3:.0f} ms"
            log.error("%s without progress; the device takes nothing until a probe answers", past)
            self._leave(
                f"{past} without progress and no other device can go on with the sequence; if"
                " the device is only slow, raise --batch-timeout-ms"
            )

        return hung

    def _progress(self) -> int | None:
        """The generator's work counter, if it keeps one (`Generator.progress`)."""
        progress = getattr(self._generator, "progress", None)
        return progress if isinstance(progress, int) else None

    def _leave(self, why: str = "") -> None:
        """The device left service: the running sequences go on elsewhere, or fail; their
        state on the device is released once it is back."""
        handed_back, self.running = self.running, []
        for gen in handed_back:
            gen.computed = 0
        self._to_release += [gen.seq.id for gen in handed_back]
        why = why or f"{self.device} is {self.state}; no other device can go on with it"
        self._model.hand_back(handed_back, BackendError(why), self._clock.time())

    async def _release(self, seq_ids: list[str]) -> None:
        """Frees ended or preempted sequences' state on the device, under the same watchdog
        as a step: a release that hangs must not hold the running sequences with it."""
        generator = self._generator
        assert generator is not None
        try:
            budget_s = self._budget.seconds(self.step_cost.predict(0))
            await self._devices.call(
                self._device, generator.release, seq_ids, budget_s, self._on_hung("release")
            )
            if self._cache is not None:
                self._rows_held = self._cache.kv_rows_held
        except OutOfService as out:
            if not out.ran:  # released once the device is back
                self._to_release = seq_ids + self._to_release
            self._leave()
        except Exception as exc:
            log.error("%s: release failed (%s: %s)", self.device, type(exc).__name__, exc)
