"""The next token from a step's logits, for the ready-made generators (torch passed in, as
they import it lazily).

Each sequence is sampled by its own params, whatever its batch mates ask: greedy (no
temperature, or 0), or at `temperature` after `top_k` and `top_p`, drawn from a generator
seeded by `seed` and the number of tokens made so far, so the same request with the same seed
writes the same text however it is batched, preempted or recomputed. Without a seed the draw
is random. `ignore_eos`, and `min_tokens` until that many are made, keep the end of sequence
from being chosen.

Every value `rules/sampling_params.py` accepts is computed: scores are the logits less their
maximum, over the temperature, in float64, so the best token scores 0 however small the
temperature (a tiny one is greedy, never an overflow to NaN), and `top_p` always keeps the
most likely token (a `top_p` that rounds to 0 is greedy, never an empty distribution). A step
carries other requests: no accepted value may make it raise.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from typing import Any

SEED_SPACE = 2**63
"""Seeds are taken modulo this: torch's generators take 64-bit seeds."""


def choose_token(torch: Any, logits: Any, params: dict[str, Any], made: int) -> int:
    """One sequence's next token from its logits (a 1-d tensor)."""
    return choose_tokens(torch, logits[None], [params], [made], ())[0]


def choose_tokens(
    torch: Any,
    logits: Any,
    params: Sequence[dict[str, Any]],
    made: Sequence[int],
    eos_ids: Collection[int],
) -> list[int]:
    """The next token of each row of `logits` ([rows, vocab], float32), by that row's params
    and count of tokens made."""
    banned = [
        bool(p.get("ignore_eos")) or count < int(p.get("min_tokens") or 0)
        for p, count in zip(params, made, strict=True)
    ]
    # max's indices, not argmax: the same first best index, 2.5x faster over a vocabulary
    # on the CPU (1.0 against 2.4 ms at 32 rows of 49,152).
    chosen: list[int] = logits.max(dim=-1).indices.tolist()
    ban = eos_ids and any(banned)  # the end's ids as a tensor only for a step that bans it
    eos = torch.tensor(sorted(eos_ids), device=logits.device) if ban else None
    for row, (p, count) in enumerate(zip(params, made, strict=True)):
        temperature = float(p.get("temperature") or 0)
        if temperature <= 0 and not (banned[row] and chosen[row] in eos_ids):
            continue
        scores = logits[row]
        if banned[row] and eos is not None:  # this row's copy only, never the whole step's
            scores = scores.index_fill(0, eos, float("-inf"))
        if temperature > 0:
            chosen[row] = _sample(torch, scores, p, temperature, count)
        else:
            chosen[row] = int(scores.max(dim=-1).indices)
    return chosen


def _sample(torch: Any, logits: Any, params: dict[str, Any], temperature: float, made: int) -> int:
    logits = logits.double()
    scores = (logits - logits.max()) / temperature
    top_k = int(params.get("top_k") or 0)
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    top_p = float(params.get("top_p") or 1.0)
    if top_p < 1.0:
        ordered, order = torch.sort(probabilities, descending=True)
        # Keep the smallest head whose mass reaches top_p (always the most likely token).
        outside = (ordered.cumsum(0) - ordered) >= top_p
        outside[0] = False
        ordered = ordered.masked_fill(outside, 0.0)
        probabilities = torch.zeros_like(probabilities).scatter(0, order, ordered)
    seed = params.get("seed")
    start = random.getrandbits(63) if seed is None else int(seed)
    draw = torch.Generator().manual_seed((start + made) % SEED_SPACE)
    return int(torch.multinomial(probabilities.cpu(), 1, generator=draw))
