"""Which running sequences give up their KV room on a device (`step_loop.py` asks).

Grown past the budget, the newest Batch API line's sequence (IDLE_RANK) goes first, else the
newest sequence. An online prompt that does not fit preempts running batch-line sequences,
newest first, where releasing them makes it fit. Put back, a batch line waits behind every
online prompt (`GenerationModel.put_back`), so a long batch generation holds KV room an
online prompt needs for one step at most; what it made is kept and recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..models.generators import PrefixCache
from ..rules.tenants import IDLE_RANK
from .request import Generation


def over_budget(running: Sequence[Generation]) -> Generation:
    """The sequence to preempt when the running ones outgrow the budget."""
    lines = (gen for gen in reversed(running) if gen.tier_rank == IDLE_RANK)
    return next(lines, running[-1])


def frees(gen: Generation, cache: PrefixCache | None) -> int:
    """What preempting `gen` frees of the budget: all it holds that no other holds."""
    own = gen.computed if cache is None else cache.own_rows(gen.seq.id)
    return gen.held_tokens - gen.computed + own


def for_online(
    gen: Generation, running: Sequence[Generation], short: int, cache: PrefixCache | None
) -> list[Generation]:
    """The batch lines' sequences, newest first, whose release leaves `short` more tokens
    for `gen`, an online prompt; none for a batch line, or if all of them would not."""
    lines = [line for line in reversed(running) if line.tier_rank == IDLE_RANK]
    if gen.tier_rank == IDLE_RANK or short <= 0 or sum(frees(g, cache) for g in lines) < short:
        return []
    victims, freed = [], 0
    for line in lines:
        if freed >= short:
            break
        victims.append(line)
        freed += frees(line, cache)
    return victims
