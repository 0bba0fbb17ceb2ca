"""Log probabilities inside the batched step, for the rows that ask (vLLM's `logprobs` and
`prompt_logprobs` params; torch passed in, as the generators import it lazily).

They are the **raw** log-probabilities, vLLM's default: `log_softmax` in float32 of the
model's logits, before temperature, `top_k`, `top_p` and the end-of-sequence bans of
`ignore_eos` and `min_tokens` (so a sampled answer reports what the model thought of each
token, whatever the sampling made of it). A step computes them once for all the rows that ask,
in one `log_softmax` and one `topk` over just those rows: a row that does not ask costs
nothing. A prompt's log-probabilities (`prompt_logprobs`, what `echo` reports) need the logits
at every position of its prefill, so a sequence asking for them computes its whole prompt
(no cached prefix is taken for it) and its chunks' hidden states go through the output head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Candidate:
    """One token and its log-probability."""

    token_id: int
    token: bytes
    """The token's own bytes (a byte-level token may be part of a character)."""
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability and the most likely tokens at its position, best first."""

    token_id: int
    token: bytes
    logprob: float | None
    """None for a prompt's first token, which nothing precedes."""
    top: tuple[Candidate, ...] = ()


def asks(params: dict[str, Any], name: str) -> int | None:
    """How many alternatives a sequence's params ask for under `name` (None: not asked)."""
    value = params.get(name)
    return None if value is None else int(value)


def rows_logprobs(
    torch: Any,
    logits: Any,
    tokens: Sequence[int],
    tops: Sequence[int],
    token_bytes: Callable[[int], bytes],
) -> list[TokenLogprob]:
    """Each row's `tokens[i]` log-probability and its `tops[i]` best alternatives, from
    `logits` ([rows, vocab], any float type): one log_softmax and one topk for all rows."""
    scores = torch.log_softmax(logits.float(), dim=-1)
    picked = scores.gather(1, torch.tensor(tokens, device=scores.device)[:, None])[:, 0]
    most = max(tops, default=0)
    values: list[list[float]] = []
    ids: list[list[int]] = []
    if most:
        top = scores.topk(most, dim=-1)
        values, ids = top.values.tolist(), top.indices.tolist()
    out = []
    for row, (token, logprob) in enumerate(zip(tokens, picked.tolist(), strict=True)):
        count = tops[row]
        pairs = zip(ids[row][:count], values[row][:count], strict=True) if count else ()
        # A token a grammar forbids (masked to -inf) is no alternative: never listed.
        alternatives = tuple(Candidate(i, token_bytes(i), v) for i, v in pairs if v > -math.inf)
        out.append(TokenLogprob(token, token_bytes(token), logprob, alternatives))
    return out


def chosen_logprobs(
    torch: Any,
    logits: Any,
    params: Sequence[dict[str, Any]],
    chosen: Sequence[int],
    token_bytes: Callable[[int], bytes],
) -> dict[int, TokenLogprob]:
    """The chosen tokens' log-probabilities, by row, for the rows whose params ask
    (`logprobs`); the others cost nothing."""
    rows = [j for j, p in enumerate(params) if asks(p, "logprobs") is not None]
    if not rows:
        return {}
    scored = rows_logprobs(
        torch,
        logits[torch.tensor(rows, device=logits.device)],
        [chosen[j] for j in rows],
        [asks(params[j], "logprobs") or 0 for j in rows],
        token_bytes,
    )
    return dict(zip(rows, scored, strict=True))
