"""One generation model's compiled grammars (structured output, forced tool calls): compiled
on a worker thread of their own, never on the event loop nor inside a step, and cached by
their canonical text, so that the thousandth request with a schema pays a dictionary look-up.

A grammar is compiled before its request is queued: one that does not compile, or is not
compiled within `--grammar-compile-timeout-ms`, is refused (400, naming the field and the
reason) before any device sees the request. The cache holds `--grammar-cache-size` entries,
least recently used out first; a failure is cached like a success, so a bad schema sent
again is refused at once. Requests that ask for a grammar being compiled wait for the same
compile. A compile past the bound runs on to its end (the engine cannot be interrupted) and
its outcome is cached; the bound counts the wait behind other compiles.

Compiles run one at a time (each takes CPU the steps may want), except that a compile past
its bound no longer holds the others up: the next one starts on another thread beside it,
so one client's pathological grammar does not time out everyone else's. At most
`MAX_OVERDUE` overdue compiles hold threads at once; past that, new ones wait.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..clock import Clock, Timer
from ..errors import InvalidInput
from ..models.grammar import Compiled, GrammarError, GrammarSpec

MAX_GRAMMAR_CHARS = 200_000
"""The longest canonical text a grammar may have: a bound on what one compile may cost."""

MAX_OVERDUE = 2
"""Compiles past their bound that may hold a thread while the next runs beside them."""

Compile = Callable[[GrammarSpec], Compiled]
_Outcome = Compiled | GrammarError


class Grammars:
    def __init__(
        self,
        compile_grammar: Compile | None,
        clock: Clock,
        *,
        label: str,
        cache_size: int,
        timeout_s: float,
    ) -> None:
        self._compile = compile_grammar
        self._clock = clock
        self._label = label
        self._cache_size = cache_size
        self._timeout_s = timeout_s
        self._cache: OrderedDict[GrammarSpec, _Outcome] = OrderedDict()
        self._compiling: dict[GrammarSpec, asyncio.Future[_Outcome]] = {}
        """Each grammar asked for and not yet compiled, and what its requests wait on."""
        self._queued: deque[GrammarSpec] = deque()
        self._running: dict[GrammarSpec, Timer] = {}
        """Compiles on a thread, and the timer that marks each overdue at its bound."""
        self._overdue: set[GrammarSpec] = set()
        self._threads: ThreadPoolExecutor | None = None
        self.compiles = 0
        """Grammars compiled (not found in the cache)."""

    def __len__(self) -> int:
        return len(self._cache)

    async def compiled(self, spec: GrammarSpec, field: str) -> Compiled:
        """`spec` compiled, from the cache or the compile thread; InvalidInput (400) naming
        `field` where it cannot be."""
        if self._compile is None:
            raise InvalidInput(
                f'"{field}": model {self._label} cannot constrain its output (its generator'
                " has no compile_grammar)"
            )
        if len(spec.text) > MAX_GRAMMAR_CHARS:
            raise InvalidInput(
                f'"{field}" is {len(spec.text)} characters as compiled; the limit is'
                f" {MAX_GRAMMAR_CHARS}"
            )
        outcome = self._cache.get(spec)
        if outcome is not None:
            self._cache.move_to_end(spec)
            return _checked(outcome, field)
        future = self._compiling.get(spec)
        if future is None:
            future = self._start(spec)
        late = asyncio.Event()
        timer = self._clock.call_at(self._clock.time() + self._timeout_s, late.set)
        waiting = asyncio.ensure_future(late.wait())
        try:
            await asyncio.wait((future, waiting), return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            waiting.cancel()
        if not future.done():
            raise InvalidInput(
                f'"{field}" was not compiled within {self._timeout_s * 1e3:.0f} ms'
                " (--grammar-compile-timeout-ms): simplify it"
            )
        return _checked(future.result(), field)

    def close(self) -> None:
        for timer in self._running.values():
            timer.cancel()
        for future in self._compiling.values():
            future.cancel()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)

    def _start(self, spec: GrammarSpec) -> asyncio.Future[_Outcome]:
        future = self._compiling[spec] = asyncio.get_running_loop().create_future()
        self._queued.append(spec)
        self._run_next()
        return future

    def _run_next(self) -> None:
        """Starts queued compiles while none is running within its bound, and overdue ones
        leave a thread free."""
        while (
            self._queued
            and len(self._running) == len(self._overdue)
            and len(self._overdue) <= MAX_OVERDUE
        ):
            spec = self._queued.popleft()
            if self._threads is None:
                label = f"batchserve-grammars-{self._label}"
                self._threads = ThreadPoolExecutor(1 + MAX_OVERDUE, label)
            loop = asyncio.get_running_loop()
            running = loop.run_in_executor(self._threads, self._compile_one, spec)
            due = self._clock.time() + self._timeout_s
            self._running[spec] = self._clock.call_at(due, self._past_bound, spec)
            running.add_done_callback(functools.partial(self._finished, spec))

    def _past_bound(self, spec: GrammarSpec) -> None:
        self._overdue.add(spec)
        self._run_next()

    def _finished(self, spec: GrammarSpec, running: asyncio.Future[_Outcome]) -> None:
        self._running.pop(spec).cancel()
        self._overdue.discard(spec)
        future = self._compiling.pop(spec)
        if future.done():  # closed meanwhile
            return
        if running.cancelled():
            future.cancel()
        elif (error := running.exception()) is not None:
            future.set_exception(error)
        else:
            self._keep(spec, running.result())
            future.set_result(running.result())
        self._run_next()

    def _compile_one(self, spec: GrammarSpec) -> _Outcome:
        assert self._compile is not None
        try:
            return self._compile(spec)
        except GrammarError as error:
            return error

    def _keep(self, spec: GrammarSpec, outcome: _Outcome) -> None:
        self.compiles += 1
        self._cache[spec] = outcome
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)


def _checked(outcome: _Outcome, field: str) -> Compiled:
    if isinstance(outcome, GrammarError):
        raise InvalidInput(f'"{field}" does not compile: {outcome}')
    return outcome
