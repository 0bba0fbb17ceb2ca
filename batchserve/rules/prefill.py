"""Prefill shared fairly: pure.

A step of a chunked-prefill generator has a budget of tokens. What the decoding sequences
leave of it is split between the prompts still prefilling by max-min fairness, as batch work
is shared: first between tenants, by their weights, then equally between each tenant's
prompts; a share a prompt does not need goes to the others. A short prompt beside a long one
then finishes its prefill in a few steps while the long one goes on in chunks, instead of
waiting for all of it (arrival order); one tenant's many prompts do not slow another's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prefill:
    """One prompt's prefill still to do: whose it is, its tenant's weight, and its tokens."""

    tenant: str
    weight: float
    tokens: int


def fair_split(budget: int, wants: list[Prefill]) -> list[int]:
    """The tokens each of `wants` (in the order they were admitted) takes of `budget`:
    weighted max-min shares between tenants, then equal shares between a tenant's prompts;
    tokens left by rounding go to the earliest."""
    tenants: dict[str, list[int]] = {}
    for index, want in enumerate(wants):
        tenants.setdefault(want.tenant, []).append(index)
    groups = list(tenants.values())
    per_tenant = _water_fill(
        budget,
        [sum(wants[i].tokens for i in group) for group in groups],
        [wants[group[0]].weight for group in groups],
    )
    given = [0] * len(wants)
    for group, share in zip(groups, per_tenant, strict=True):
        split = _water_fill(share, [wants[i].tokens for i in group], [1.0] * len(group))
        for index, tokens in zip(group, split, strict=True):
            given[index] = tokens
    return given


def _water_fill(budget: int, wants: list[int], weights: list[float]) -> list[int]:
    """Max-min fair shares of `budget` in whole tokens, by `weights`, none above its want."""
    given = [0] * len(wants)
    left = max(0, budget)
    active = [i for i, want in enumerate(wants) if want > 0]
    while left > 0 and active:
        total = sum(weights[i] for i in active)
        shares = [min(wants[i] - given[i], int(left * weights[i] / total)) for i in active]
        if not any(shares):  # less than one token each: the earliest take one apiece
            for i in active[:left]:
                given[i] += 1
            break
        for i, share in zip(active, shares, strict=True):
            given[i] += share
            left -= share
        active = [i for i in active if given[i] < wants[i]]
    return given
