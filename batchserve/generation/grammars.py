"""One generation model's compiled grammars (structured output, forced tool calls): compiled
on worker threads of their own, never on the event loop nor inside a step, and cached by
their canonical text, so that the thousandth request with a schema pays a dictionary look-up.

A grammar is compiled before its request is queued: one that does not compile, or is not
compiled within `--grammar-compile-timeout-ms`, is refused (400, naming the field and the
reason) before any device sees the request. The cache holds `--grammar-cache-size` entries,
least recently used out first; a failure is cached like a success, so a bad schema sent
again is refused at once. Requests that ask for a grammar being compiled wait for the same
compile. A compile past the bound runs on to its end (the engine cannot be interrupted) and
its outcome is cached; the bound counts the wait behind other compiles.

Compiles run one at a time (each takes CPU the steps may want), except that one running
longer than `SLOW_COMPILE_S` (or the bound, if shorter) no longer holds the others up: the
next starts on another thread beside it, so one client's pathological grammar does not time
out everyone else's. At most `MAX_SLOW` slow compiles hold threads at once; then new ones
wait for one of them to end. A queued grammar whose requests have all given up is dropped,
not compiled.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..clock import Clock, Timer
from ..errors import InvalidInput, NotReady
from ..models.grammar import Compiled, GrammarError, GrammarSpec

MAX_GRAMMAR_CHARS = 200_000
"""The longest canonical text a grammar may have: a bound on what one compile may cost."""

SLOW_COMPILE_S = 1.0
"""A compile running longer lets the next one start beside it (most take 1-150 ms)."""
MAX_SLOW = 3
"""Slow compiles that may hold threads at once: the threads there are."""

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
        self._waiters: Counter[GrammarSpec] = Counter()
        self._queued: deque[GrammarSpec] = deque()
        self._running: dict[GrammarSpec, Timer] = {}
        """Compiles on a thread, and the timer that marks each slow."""
        self._slow: set[GrammarSpec] = set()
        self._threads: ThreadPoolExecutor | None = None
        self._closed = False
        self.compiles = 0
        """Grammars compiled (not found in the cache)."""

    def __len__(self) -> int:
        return len(self._cache)

    async def compiled(self, spec: GrammarSpec, field: str) -> Compiled:
        """`spec` compiled, from the cache or a compile thread; InvalidInput (400) naming
        `field` where it cannot be."""
        if self._closed:
            raise NotReady(f"model {self._label} is shutting down")
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
        self._waiters[spec] += 1
        try:
            await asyncio.wait((future, waiting), return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            waiting.cancel()
            in_time = future.done()
            self._left(spec)
        if not in_time:
            raise InvalidInput(
                f'"{field}" was not compiled within {self._timeout_s * 1e3:.0f} ms'
                " (--grammar-compile-timeout-ms): simplify it"
            )
        return _checked(future.result(), field)

    def close(self) -> None:
        """Answers what still waits (503), refuses what comes after, and leaves running
        compiles to end on their own."""
        self._closed = True
        for timer in self._running.values():
            timer.cancel()
        for spec, future in self._compiling.items():
            if future.done():
                continue
            if spec in self._waiters:
                future.set_exception(NotReady(f"model {self._label} is shutting down"))
            else:  # nobody to tell (an unheard exception would be logged as an error)
                future.cancel()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)

    def _start(self, spec: GrammarSpec) -> asyncio.Future[_Outcome]:
        future = self._compiling[spec] = asyncio.get_running_loop().create_future()
        self._queued.append(spec)
        self._run_next()
        return future

    def _left(self, spec: GrammarSpec) -> None:
        """One request stopped waiting for `spec`: a queued spec nobody waits for is dropped."""
        self._waiters[spec] -= 1
        if self._waiters[spec] > 0:
            return
        del self._waiters[spec]
        if spec in self._queued:
            self._queued.remove(spec)
            self._compiling.pop(spec).cancel()

    def _run_next(self) -> None:
        """Starts a queued compile where none runs but slow ones, and fewer than `MAX_SLOW`
        of those hold threads."""
        while self._queued and len(self._running) == len(self._slow) < MAX_SLOW:
            spec = self._queued.popleft()
            if self._threads is None:
                label = f"batchserve-grammars-{self._label}"
                self._threads = ThreadPoolExecutor(MAX_SLOW, label)
            loop = asyncio.get_running_loop()
            running = loop.run_in_executor(self._threads, self._compile_one, spec)
            due = self._clock.time() + min(SLOW_COMPILE_S, self._timeout_s)
            self._running[spec] = self._clock.call_at(due, self._is_slow, spec)
            running.add_done_callback(functools.partial(self._finished, spec))

    def _is_slow(self, spec: GrammarSpec) -> None:
        self._slow.add(spec)
        self._run_next()

    def _finished(self, spec: GrammarSpec, running: asyncio.Future[_Outcome]) -> None:
        self._running.pop(spec).cancel()
        self._slow.discard(spec)
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
