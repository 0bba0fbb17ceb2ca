"""One generation request: its sequence, its place in line, and the text it streams out.

The scheduler (`step_loop.py`) feeds it each token a step makes; it cuts the text at a stop
string (which is not part of the output; looked for once `min_tokens` are made), holding back
only what could still turn out to be the start of one, and ends at the end of sequence or at
`max_tokens`. Whoever waits reads the
text as it comes (`pieces`) and, once it ends, the outcome. `cancel` (a client that left, a
deadline before the first token) tells the scheduler to drop and release the sequence before
its next step.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncGenerator
from typing import Any, Literal

from ..errors import BatchserveError, DeadlineExceeded
from ..models.generators import Made, Seq, StepAnswer
from ..models.logprobs import TokenLogprob
from ..rules.prefill import Prefill

FinishReason = Literal["stop", "length"]


class GenState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


class Generation:
    """Created by the engine, fed by one device's scheduler, read by one waiter."""

    def __init__(
        self,
        seq: Seq,
        *,
        prompt_tokens: int,
        max_tokens: int,
        stops: tuple[str, ...],
        arrival: float,
        deadline: float,
        model: str,
        version: str,
        tenant: str = "",
        tier_rank: int = 0,
        tenant_weight: float = 1.0,
        request_id: str | None = None,
    ) -> None:
        self.seq = seq
        self.request_id = seq.id if request_id is None else request_id
        """The id its client knows it by; `seq.id`, unique across tenants, is the
        generator's handle on it."""
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.deadline = deadline
        """Bounds the wait for the first token; once running, it goes on to its end."""
        self.model, self.version = model, version
        self.tenant, self.tier_rank, self.tenant_weight = tenant, tier_rank, tenant_weight
        self.state = GenState.WAITING
        self.cancelled = False
        self.device = ""
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_reason: FinishReason | None = None
        self.error: BatchserveError | None = None
        self.preemptions = 0
        self.times_passed = 0
        self.computed = 0
        """Its tokens in its device's KV cache; 0 once released (preempted, handed on)."""
        self.cached_at_arrival = 0
        """Prompt tokens a device's cache held when it arrived: while it waits, its prefill
        is predicted as the rest (a shared system prompt is not counted again for each)."""
        self.cached_tokens = 0
        """Prompt tokens its device's cache held when the prefill that made its first token
        began: reported as `usage.prompt_tokens_details.cached_tokens`."""
        """Sequences admitted past it while it waited for room (the scheduler bounds it)."""
        self._stops = tuple(s for s in stops if s)
        self._min_tokens = int(seq.params.get("min_tokens") or 0)
        """Stop strings are not looked for before it has made this many tokens (vLLM's)."""
        seq.max_tokens = max_tokens
        self._held = ""
        """Made but not yet given out: it may be the start of a stop string."""
        self._output: list[str] = []
        self._pieces: asyncio.Queue[tuple[str, int] | None] = asyncio.Queue()
        """Each piece of text with the count of tokens made when it was given out."""
        self.logprobs: list[TokenLogprob] = []
        """Each token's log-probability, where its params ask (`logprobs`)."""
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        """The prompt's tokens' (the first has none), where its params ask
        (`prompt_logprobs`): a recomputed prefill writes the same numbers again."""
        self.tokens_read = 0
        """Tokens made when the last piece `pieces()` gave out was: a stream's logprobs
        for that piece are those of the tokens since the piece before."""

    def __repr__(self) -> str:
        return f"<Generation {self.request_id} {self.state.value} tokens={len(self.seq.tokens)}>"

    @property
    def held_tokens(self) -> int:
        """What it holds of a device's budget in its next step."""
        return self.prompt_tokens + len(self.seq.tokens) + 1

    @property
    def uncomputed(self) -> int:
        """Tokens its next step must process: its prompt's and made tokens not yet cached
        (at least one: the token to decode from)."""
        return max(1, self.prompt_tokens + len(self.seq.tokens) - self.computed)

    @property
    def prefill_tokens(self) -> int:
        """Tokens it must still prefill before it can make a token (0 once decoding): the one
        count of a request's prefill work, which fair shares and the first-token forecast
        read (a cache of prefixes makes it count only what is not cached)."""
        uncomputed = self.uncomputed
        if self.state is GenState.WAITING and not self.computed:
            uncomputed = max(1, uncomputed - self.cached_at_arrival)
        return uncomputed if uncomputed > 1 else 0

    def prefill(self) -> Prefill:
        """Its prefill still to do, as the fair shares of `rules/prefill.py` read it."""
        return Prefill(self.tenant, self.tenant_weight, self.prefill_tokens)

    @property
    def tokens_this_step(self) -> int:
        """Tokens its step in hand processes: its chunk, or all it has uncomputed."""
        return self.uncomputed if self.seq.chunk is None else self.seq.chunk

    @property
    def output(self) -> str:
        return "".join(self._output)

    @property
    def done(self) -> bool:
        return self.state is GenState.DONE

    # The scheduler's side

    def add(self, token: StepAnswer, now: float) -> bool:
        """Takes what a step made for it (None: the end of sequence; `Made()`: nothing yet, a
        prefill chunk); True once it has ended."""
        if isinstance(token, Made):
            text, ended, counted = token.text, token.end, token.token_id is not None
            if token.prompt_logprobs:
                self._note_prompt_logprobs(token)
            if not counted and not ended:
                return False  # still prefilling: no token, no first-token time
            if token.token_id is not None:
                self.seq.token_ids.append(token.token_id)
            if token.logprob is not None:  # the end's too, where the model chose it
                self.logprobs.append(token.logprob)
        else:
            text, ended, counted = token or "", token is None, token is not None
        if self.first_token_at is None:
            self.first_token_at = now
        if counted:
            self.seq.tokens.append(text)
        self._held += text
        if len(self.seq.tokens) >= self._min_tokens:
            cut = min((i for s in self._stops if (i := self._held.find(s)) >= 0), default=-1)
            if cut >= 0:
                self._held = self._held[:cut]
                self._finish("stop", now)
                return True
        if ended:  # max_tokens 0 (echo) ends at its prompt's end: cut by the length
            self._finish("length" if self.max_tokens == 0 else "stop", now)
            return True
        if len(self.seq.tokens) >= self.max_tokens:
            self._finish("length", now)
            return True
        keep = self._stop_prefix_length()
        self._give(self._held[: len(self._held) - keep])
        self._held = self._held[len(self._held) - keep :]
        return False

    def fail(self, error: BatchserveError, now: float) -> None:
        if self.done:
            return
        self.error = error
        self.state = GenState.DONE
        self.finished_at = now
        self._pieces.put_nowait(None)

    def expire(self, now: float) -> None:
        """The deadline's timer: without a first token by now, it ends 504."""
        if self.first_token_at is None and not self.done:
            self.cancelled = True
            self.fail(DeadlineExceeded("no token was made before the request's deadline"), now)

    def cancel(self) -> None:
        """Its waiter left: the scheduler drops it before the next step."""
        self.cancelled = True

    def _note_prompt_logprobs(self, made: Made) -> None:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * self.prompt_tokens
        start = made.prompt_start
        self.prompt_logprobs[start : start + len(made.prompt_logprobs)] = made.prompt_logprobs

    def _stop_prefix_length(self) -> int:
        """The longest end of the held text that a stop string starts with."""
        for size in range(min(len(self._held), max(map(len, self._stops), default=1) - 1), 0, -1):
            tail = self._held[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0

    def _give(self, text: str) -> None:
        if text:
            self._output.append(text)
            self._pieces.put_nowait((text, len(self.seq.tokens)))

    def _finish(self, reason: FinishReason, now: float) -> None:
        self._give(self._held)
        self._held = ""
        self.finish_reason = reason
        self.state = GenState.DONE
        self.finished_at = now
        self._pieces.put_nowait(None)

    # The waiter's side

    async def pieces(self) -> AsyncGenerator[str, None]:
        """The output as it is made; raises the request's error if it fails."""
        while (piece := await self._pieces.get()) is not None:
            text, self.tokens_read = piece
            yield text
        if self.error is not None:
            raise self.error

    async def result(self) -> str:
        """The whole output once it has ended; raises its error."""
        return "".join([piece async for piece in self.pieces()])

    def summary(self) -> dict[str, Any]:
        """How it ended: the final numbers of an answer or a stream."""
        ended = self.finished_at if self.finished_at is not None else self.arrival
        first = self.first_token_at
        return {
            "tokens": len(self.seq.tokens),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "ttft_ms": None if first is None else round((first - self.arrival) * 1e3, 3),
            "latency_ms": round((ended - self.arrival) * 1e3, 3),
            "model": self.model,
            "version": self.version,
            "request_id": self.request_id,
        }
