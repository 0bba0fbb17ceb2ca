"""The generation models an engine runs: each version's line of waiting sequences, its
devices' schedulers, and which version a request goes to.

A `GenerationModel` owns the queue its devices take from (fair between tenants, by tier, as
for batch requests; preempted sequences go back ahead of it, a Batch API line's behind every
online prompt) and its `StepLoop`s; it starts their tasks and, closing, cancels and awaits
them. The devices themselves (threads, watchdog, health) are the engine's `Devices`, shared
with the batch models placed on them. `Generators` holds the models by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..clock import Clock, wait_until
from ..config import GenerateMode
from ..devices.fleet import Devices
from ..devices.health import DeviceState
from ..errors import (
    BackendError,
    BatchserveError,
    StartupError,
)
from ..models.chat_tools import plain_chat_prompt
from ..models.generators import (
    ChatFormatter,
    GeneratorFactory,
    chat_formatter,
    max_token_bytes,
    token_counter,
)
from ..models.registry import Routes, VersionState, Wording
from ..models.specs import ModelSpec
from ..rules.capacity import BatchBudget, DecayedRate
from ..rules.fair_queue import FairQueue
from ..rules.prefill import PrefillLine, work_until_done
from ..rules.tenants import IDLE_RANK
from ..tasks import CrashHandler, TaskSet
from .forks import ForkLines
from .grammars import Grammars
from .request import Generation, GenState
from .step_loop import StepLoop

DEAD = DeviceState.DEAD.value
INLINE_CHARS = 1024
"""Prompts up to this long are tokenized on the loop: about a millisecond at most."""
GATHER_S = 0.05
"""How long an idle device, given work, waits for prompts admitted beside it and still being
tokenized before its first step: a burst's prompts then prefill together, not one first alone
(16 chats of ~1,000 tokens were all in line after 18 ms on one core; alone, the first one's
step took 0.2 s before the others could start)."""
GATHER_SHARE = 0.1
"""The most of a waiting prompt's time left to its first-token deadline that the wait takes."""


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """What the metrics and the dashboard read of a generation model at a scrape."""

    label: str
    model: str
    version: str
    devices: tuple[str, ...]
    running: int
    waiting: int
    kv_used_tokens: int
    """KV-cache tokens its running sequences hold, over all its devices."""
    kv_budget_tokens: int
    tokens_per_s: float
    steps: int
    preemptions: int
    step_failures: int
    hung_steps: int
    prefix_queries: int
    """Tokens of sequences admitted, looked up in their device's prefix cache."""
    prefix_hits: int
    """Of them, those found cached (not computed again)."""
    prefill_tokens: int
    """Prompt tokens its devices computed before each sequence's first token."""


class GenerationModel:
    def __init__(
        self,
        spec: ModelSpec,
        factory: GeneratorFactory,
        device_names: list[str],
        *,
        devices: Devices,
        clock: Clock,
        mode: GenerateMode,
        step_budget: BatchBudget,
        step_tokens: tuple[int, int],
        on_crash: CrashHandler,
        grammar_cache: tuple[int, float] = (256, 10.0),
    ) -> None:
        self.spec = spec
        self._clock = clock
        self._grammar_cache = grammar_cache
        """How many compiled grammars it keeps, and the seconds a compile may take."""
        self.state = VersionState.READY
        """Always ready once the engine serves: generation models load only at start."""
        self.mode = mode
        self._factory = factory
        self.loops = [
            StepLoop(devices.get(name), devices, self, clock, step_budget, step_tokens)
            for name in device_names
        ]
        for name in device_names:  # closing waits this long for a step still inside torch
            device = devices.get(name)
            device.stop_wait_s = max(device.stop_wait_s, step_budget.seconds(None))
        self._waiting: FairQueue[Generation] = FairQueue()
        self._resumed: deque[Generation] = deque()
        """Preempted, or taken and found too big for the device that took it: next in line."""
        self._resumed_lines: deque[Generation] = deque()
        """The same, of Batch API lines: next once no online prompt waits."""
        self._forks = ForkLines(self.wake)
        """Choices of `n` taken by a device while their sibling runs on another: that one's."""
        self._line_prefill = PrefillLine()
        """The prefill of every sequence in line (waiting or resumed), by tenant."""
        self._work = asyncio.Event()
        self._online_admitting = 0
        """Its online prompts between admission and the line (tokenized, a grammar compiled);
        not the engine's count of all prompts admitting, which a drain waits for."""
        self._all_admitted: asyncio.Future[None] | None = None
        """Done once none is admitting: what an idle device given work waits for."""
        self._tasks = TaskSet(on_crash)
        self.count_tokens: Callable[[str], int] = len
        self.max_token_bytes: int | None = None
        """The most prompt bytes one token stands for (None: unknown): the bound a prompt's
        bytes are checked against before it is tokenized."""
        self._tokenizer: ThreadPoolExecutor | None = None
        """Counts prompts' tokens off the event loop (a 1 MiB prompt takes seconds)."""
        self.chat_prompt: ChatFormatter = plain_chat_prompt
        self.grammars = Grammars(None, clock, label=spec.label, cache_size=0, timeout_s=1.0)
        """Its compiled grammars, once its generator has loaded."""
        self.kv_budget = 0
        """What a lone sequence must fit: the smallest device budget, or context length."""
        self.steps = 0
        self.token_rate = DecayedRate()
        """Tokens made a second, recent."""
        self.preemptions = 0
        self.step_failures = 0
        self.hung_steps = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prefill_tokens = 0
        self.reports_logprobs = False
        """Its generator computes the `logprobs` and `prompt_logprobs` params."""
        self.vocab_size: int | None = None
        """Its generator's vocabulary size, where it takes prompts as token ids."""

    def __repr__(self) -> str:
        return f"<GenerationModel {self.spec.label} waiting={self.waiting}>"

    @property
    def max_batch_size(self) -> int:
        return self.spec.max_batch_size

    @property
    def waiting(self) -> int:
        resumed = len(self._resumed) + len(self._resumed_lines)
        return len(self._waiting) + resumed + len(self._forks)

    @property
    def dead_devices(self) -> list[str]:
        """Its devices that never serve: a batch model placed there failed to load."""
        return [loop.device for loop in self.loops if loop.state == DEAD]

    @property
    def running(self) -> int:
        return sum(len(loop.running) for loop in self.loops)

    def stats(self, now: float) -> GenerationStats:
        return GenerationStats(
            label=self.spec.label,
            model=self.spec.name,
            version=self.spec.version,
            devices=tuple(loop.device for loop in self.loops),
            running=self.running,
            waiting=self.waiting,
            kv_used_tokens=sum(loop.kv_used for loop in self.loops),
            kv_budget_tokens=sum(loop.kv_budget for loop in self.loops),
            tokens_per_s=self.token_rate.at(now),
            steps=self.steps,
            preemptions=self.preemptions,
            step_failures=self.step_failures,
            hung_steps=self.hung_steps,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            prefill_tokens=self.prefill_tokens,
        )

    async def start(self) -> None:
        """Loads the generator on its first device alone, then on the others together, then
        starts their schedulers. The first load does the one-time work (imports, a weights
        conversion) once, not racing itself on every device thread, and a model that cannot
        load fails before its other copies are loaded. A dead device (the pool's, which
        starts first) gets neither: it never serves, and admission refuses a model left
        with no other (intake.py)."""
        live = [loop for loop in self.loops if loop.state != DEAD]
        if not live:
            return
        first, *others = live
        outcomes: list[Any] = []
        for batch in ([first], others):
            outcomes += await asyncio.gather(
                *(loop.load(self._factory) for loop in batch), return_exceptions=True
            )
            self._raise_failed(live, outcomes)
        self.count_tokens = token_counter(outcomes[0])
        self.max_token_bytes = max_token_bytes(outcomes[0])
        self._tokenizer = ThreadPoolExecutor(1, f"batchserve-tokenize-{self.spec.label}")
        self.chat_prompt = chat_formatter(outcomes[0])
        self.reports_logprobs = getattr(outcomes[0], "reports_logprobs", False) is True
        vocab = getattr(outcomes[0], "vocab_size", None)
        self.vocab_size = vocab if isinstance(vocab, int) and vocab > 0 else None
        size, timeout_s = self._grammar_cache
        compile_grammar = getattr(outcomes[0], "compile_grammar", None)
        self.grammars = Grammars(
            compile_grammar if callable(compile_grammar) else None, self._clock,
            label=self.spec.label, cache_size=size, timeout_s=timeout_s,
        )  # fmt: skip
        self.kv_budget = min(loop.max_seq_tokens for loop in live)
        for loop in live:
            self._tasks.start(loop.run(self.mode), name=f"batchserve-steps-{loop.device}")

    def _raise_failed(self, loops: list[StepLoop], outcomes: list[Any]) -> None:
        for loop, outcome in zip(loops, outcomes, strict=False):
            if isinstance(outcome, StartupError):
                raise outcome
            if isinstance(outcome, BaseException):
                raise StartupError(
                    f"generator {self.spec.label} failed to load on {loop.device}:"
                    f" {type(outcome).__name__}: {outcome}"
                )

    async def aclose(self) -> None:
        self.grammars.close()
        if self._tokenizer is not None:
            self._tokenizer.shutdown(wait=False, cancel_futures=True)
        await self._tasks.aclose()

    async def prompt_tokens(self, prompt: str) -> int:
        """`prompt`'s tokens, counted on the model's tokenizer thread, not the event loop:
        a long prompt would stall every stream, probe and step watchdog meanwhile. A short
        one is counted here, where the hop to the thread would cost more than the count."""
        if len(prompt) <= INLINE_CHARS:
            return self.count_tokens(prompt)
        assert self._tokenizer is not None, "the model has not started"
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer, self.count_tokens, prompt)

    async def note_cached_prefix(self, gen: Generation) -> None:
        """Notes on `gen` how much of its prompt a device's cache holds now, for the
        first-token forecast and its wait in line; keying a long prompt's blocks means
        tokenizing it, so that is done on the tokenizer thread too."""
        loops = [loop for loop in self.loops if loop.in_service and loop.caches_prefixes]
        if not loops:
            return
        if len(gen.seq.prompt) <= INLINE_CHARS:
            gen.cached_at_arrival = max(loop.cached_tokens(gen) for loop in loops)
            return
        assert self._tokenizer is not None, "the model has not started"
        gen.cached_at_arrival = await asyncio.get_running_loop().run_in_executor(
            self._tokenizer, lambda: max(loop.cached_tokens(gen) for loop in loops)
        )

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Around an online prompt's admission: a device starting from idle waits up to
        `GATHER_S` for it (`wait_for_work`), so that a burst's first step holds all of it."""
        self._online_admitting += 1
        try:
            yield
        finally:
            self._online_admitting -= 1
            if not self._online_admitting and self._all_admitted is not None:
                self._all_admitted.set_result(None)
                self._all_admitted = None

    def submit(self, gen: Generation) -> None:
        self._waiting.push(gen)
        self._enter_line(gen)
        self.wake()

    def first_token_forecast(self, gen: Generation) -> tuple[float, float] | None:
        """Seconds from now to `gen`'s first token were it to join the line now, and with
        nothing ahead of it: the prefill done before its last token is in (with chunks, as
        the fair shares of `rules/prefill.py` give it; else all that waits), less the prefix
        a device has cached (`note_cached_prefix`), the work ahead spread over the devices
        that take work, on the one that would finish first. None while a device cannot
        predict it: no grounds to refuse anything. One pass over the running sequences, and
        a few steps for each tenant in line."""
        loops = [loop for loop in self.loops if loop.in_service]
        if not loops:
            return None
        new = gen.prefill()
        tenants = self._line_prefill.with_running(
            g.prefill() for loop in loops for g in loop.running if g.prefill_tokens
        )
        if loops[0].chunked:
            ahead = work_until_done(tenants, new) - new.tokens
        else:  # whole prompts a step: all that waits is prefilled before it, or with it
            ahead = sum(work.total for work in tenants.values())
        spread = math.ceil(ahead / len(loops)) + new.tokens
        forecasts = [loop.prefill_seconds(spread) for loop in loops]
        alone = [loop.prefill_seconds(new.tokens, alone=True) for loop in loops]
        if any(seconds is None for seconds in (*forecasts, *alone)):
            return None
        return min(s for s in forecasts if s is not None), min(s for s in alone if s is not None)

    def take(self, device: str) -> Generation | None:
        """The next sequence in line that still wants to run on `device`: one of `n` choices
        whose sibling runs on another device is left for that one (`forks.py`)."""
        while True:
            if self._resumed:
                gen = self._resumed.popleft()
            elif (left := self._forks.take(device)) is not None:
                gen = left
            elif self._resumed_lines and len(self._waiting) == self._waiting.idle:
                gen = self._resumed_lines.popleft()  # no online prompt waits
            else:
                taken = self._waiting.take(1)
                if not taken:
                    return None
                gen = taken[0]
            self._line_prefill.remove(gen)
            if not (
                gen.cancelled or gen.done or self._forks.left_elsewhere(gen, device, self.loops)
            ):
                return gen

    def put_back(self, gen: Generation) -> None:
        line = self._resumed_lines if gen.tier_rank == IDLE_RANK else self._resumed
        line.appendleft(gen)
        self._enter_line(gen)
        self.wake()

    def _enter_line(self, gen: Generation) -> None:
        if gen.prefill_tokens:
            self._line_prefill.add(gen, gen.prefill())

    def hand_back(self, gens: list[Generation], error: BackendError, now: float) -> None:
        """Sequences of a device that left service (a hung step): back to the head of the
        line, tokens and all, while another device can go on with them; failed (500, with
        `error`) otherwise."""
        if any(loop.in_service for loop in self.loops):
            gens = gens + self._forks.out_of_service(self.loops)  # and the choices left there
            for gen in reversed(gens):
                if not gen.done and not gen.cancelled:
                    gen.state = GenState.WAITING
                    self.put_back(gen)
            return
        for gen in gens:
            gen.fail(error, now)

    def discard(self, gen: Generation) -> None:
        """Its waiter is done with it: still waiting, it leaves the line now."""
        if gen.state is GenState.WAITING:
            self._waiting.discard(gen)
            for line in (self._resumed, self._resumed_lines):
                if gen in line:
                    line.remove(gen)
            self._forks.discard(gen)
            self._line_prefill.remove(gen)

    def wake(self) -> None:
        self._work.set()

    async def wait_for_work(self, device: str) -> None:
        """Returns once there is work for `device` (idle), and then, while online prompts of
        this model are still being admitted, once they are in line too (`_gather_until`)."""
        lines = (self._waiting, self._resumed, self._resumed_lines)
        while not any(lines) and not self._forks.has(device):
            self._work.clear()
            await self._work.wait()
        until = self._gather_until(device)
        if until is not None:
            if self._all_admitted is None:
                self._all_admitted = asyncio.get_running_loop().create_future()
            await wait_until(self._clock, self._all_admitted, until)

    def _gather_until(self, device: str) -> float | None:
        """When an idle `device` stops waiting for prompts still in admission: `GATHER_S` from
        now, or a tenth of the time the most urgent new prompt in line has left to its
        first-token deadline if sooner. None (no wait) where nothing is in admission; where
        another device of the model is idle too (the burst goes to both, as before); or where
        the line holds streams already under way (preempted, handed back, forks)."""
        if not self._online_admitting or self._resumed or self._resumed_lines:
            return None
        if self._forks.has(device) or any(
            loop.device != device and loop.in_service and not loop.running for loop in self.loops
        ):
            return None
        now = self._clock.time()
        slack = min((gen.deadline - now for gen in self._waiting), default=GATHER_S)
        wait = min(GATHER_S, GATHER_SHARE * slack)
        return now + wait if wait > 0 else None

    def fail_all(self, error: BatchserveError, now: float) -> None:
        """Ends every sequence, waiting or running, with `error` (a drain that timed out)."""
        for gen in [*self._resumed, *self._resumed_lines, *self._forks, *self._waiting]:
            gen.fail(error, now)
        for loop in self.loops:
            for gen in loop.running:
                gen.fail(error, now)
        self._resumed.clear()
        self._resumed_lines.clear()
        self._forks.clear()
        self._waiting.clear()
        self._line_prefill.clear()

    def describe(self) -> dict[str, Any]:
        return {
            "version": self.spec.version,
            "state": self.state.value,
            "kind": "generation",
            "weight": self.spec.weight,
            "devices": [loop.device for loop in self.loops],
            "kv_budget_tokens": self.kv_budget,
            "mode": self.mode,
        }


GENERATION_WORDING = Wording("generation model", "generates with", "no model")


class Generators(Routes[GenerationModel]):
    """Every generation model version by name; requests are routed to them as batch
    requests are to batch versions (`models/registry.py`'s `Routes`)."""

    def __init__(self, models: list[GenerationModel]) -> None:
        super().__init__(models, GENERATION_WORDING)

    async def __aenter__(self) -> Generators:
        """Loads every generation model on its devices and starts their schedulers."""
        try:
            await asyncio.gather(*(model.start() for model in self))
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.gather(*(model.aclose() for model in self))

    def states(self) -> dict[str, str]:
        return {
            f"{loop.device} ({model.spec.label})": loop.state
            for model in self
            for loop in model.loops
        }

    def fail_all(self, error: BatchserveError, now: float) -> None:
        for model in self:
            model.fail_all(error, now)
