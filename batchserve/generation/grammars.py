"""One generation model's compiled grammars (structured output, forced tool calls): compiled
on a worker thread of their own, never on the event loop nor inside a step, and cached by
their canonical text, so that the thousandth request with a schema pays a dictionary look-up.

A grammar is compiled before its request is queued: one that does not compile, or is not
compiled within `--grammar-compile-timeout-ms`, is refused (400, naming the field and the
reason) before any device sees the request. The cache holds `--grammar-cache-size` entries,
least recently used out first; a failure is cached like a success, so a bad schema sent
again is refused at once. Requests that ask for a grammar being compiled wait for the same
compile. A compile past the bound runs on to its end (the engine cannot be interrupted) and
its outcome is cached; the bound counts the wait behind other compiles on the thread.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..clock import Clock
from ..errors import InvalidInput
from ..models.grammar import Compiled, GrammarError, GrammarSpec

MAX_GRAMMAR_CHARS = 200_000
"""The longest canonical text a grammar may have: a bound on what one compile may cost."""

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
        self._thread: ThreadPoolExecutor | None = None
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
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

    def _start(self, spec: GrammarSpec) -> asyncio.Future[_Outcome]:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, f"batchserve-grammars-{self._label}")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._thread, self._compile_one, spec)
        self._compiling[spec] = future
        future.add_done_callback(lambda done: self._keep(spec, done))
        return future

    def _compile_one(self, spec: GrammarSpec) -> _Outcome:
        assert self._compile is not None
        try:
            return self._compile(spec)
        except GrammarError as error:
            return error

    def _keep(self, spec: GrammarSpec, done: asyncio.Future[_Outcome]) -> None:
        del self._compiling[spec]
        if done.cancelled() or done.exception() is not None:
            return
        self.compiles += 1
        self._cache[spec] = done.result()
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)


def _checked(outcome: _Outcome, field: str) -> Compiled:
    if isinstance(outcome, GrammarError):
        raise InvalidInput(f'"{field}" does not compile: {outcome}')
    return outcome
