"""Prefill shared fairly, and the first token it predicts: pure, time passed in.

A step of a chunked-prefill generator has a budget of tokens. What the decoding sequences
leave of it is split between the prompts still prefilling by max-min fairness, as batch work
is shared: first between tenants, by their weights, then equally between each tenant's
prompts; a share a prompt does not need goes to the others. A short prompt beside a long one
then finishes its prefill in a few steps while the long one goes on in chunks, instead of
waiting for all of it (arrival order); one tenant's many prompts do not slow another's.

The same sharing predicts a new prompt's first token: until its last token is in, each other
prompt of its tenant gets at most as much as it does, and each other tenant its weight's
share of what its tenant gets. A request whose first token is predicted past its deadline is
refused at arrival instead of waiting to be answered 504: 503 with when to retry where the
work ahead is the cause, 504 at once where its own prefill alone cannot make it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import Overloaded, PrefillTooLong


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


BUCKETS = 64
"""Powers of two of a prompt's tokens: bucket k holds prompts of 2**(k-1) to 2**k - 1."""


class TenantWork:
    """One tenant's prefills still to do, counted by powers of two of their tokens: what
    they take beside a new prompt of `p` tokens (each at most `p`) is then a sum over the
    buckets, not over the prompts, exact but for the one bucket that holds `p` (within a
    factor of two of it, never short)."""

    __slots__ = ("_counts", "_sums", "total", "weight")

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.total = 0
        self._counts = [0] * BUCKETS
        self._sums = [0] * BUCKETS

    def __repr__(self) -> str:
        return f"<TenantWork prompts={sum(self._counts)} tokens={self.total}>"

    @property
    def empty(self) -> bool:
        return not any(self._counts)

    def add(self, tokens: int, sign: int = 1) -> None:
        bucket = min(tokens.bit_length(), BUCKETS - 1)
        self._counts[bucket] += sign
        self._sums[bucket] += sign * tokens
        self.total += sign * tokens

    def capped(self, p: int) -> int:
        """The sum over its prompts of min(tokens, p)."""
        work = 0
        for bucket, (count, tokens) in enumerate(zip(self._counts, self._sums, strict=True)):
            if count:
                high = (1 << bucket) - 1  # the bucket's largest prompt
                low = 1 << max(0, bucket - 1)
                work += tokens if high <= p else count * p if low >= p else min(tokens, count * p)
        return work

    def copy(self) -> TenantWork:
        copied = TenantWork(self.weight)
        copied.total, copied._counts, copied._sums = self.total, [*self._counts], [*self._sums]
        return copied


class PrefillLine:
    """The prefill waiting in a line, kept by tenant as sequences join and leave it, so a
    forecast costs a few steps for each tenant, not a pass over the line."""

    def __init__(self) -> None:
        self._held: dict[object, Prefill] = {}
        self._tenants: dict[str, TenantWork] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __repr__(self) -> str:
        return f"<PrefillLine prompts={len(self)} tenants={len(self._tenants)}>"

    def add(self, key: object, prefill: Prefill) -> None:
        self.remove(key)
        self._held[key] = prefill
        work = self._tenants.get(prefill.tenant)
        if work is None:
            work = self._tenants[prefill.tenant] = TenantWork(prefill.weight)
        work.weight = prefill.weight
        work.add(prefill.tokens)

    def remove(self, key: object) -> None:
        prefill = self._held.pop(key, None)
        if prefill is None:
            return
        work = self._tenants[prefill.tenant]
        work.add(prefill.tokens, -1)
        if work.empty:
            del self._tenants[prefill.tenant]

    def clear(self) -> None:
        self._held.clear()
        self._tenants.clear()

    def with_running(self, running: Iterable[Prefill]) -> dict[str, TenantWork]:
        """The line's work by tenant, and the prefills of the running sequences besides."""
        tenants = {name: work.copy() for name, work in self._tenants.items()}
        for prefill in running:
            work = tenants.get(prefill.tenant)
            if work is None:
                work = tenants[prefill.tenant] = TenantWork(prefill.weight)
            work.add(prefill.tokens)
        return tenants


def work_until_done(tenants: Mapping[str, TenantWork], new: Prefill) -> int:
    """Prefill tokens processed, `new`'s own among them, until `new`'s last one is in when
    the prefills of `tenants` share the steps with it fairly (and nothing else arrives):
    each prompt of its tenant at most as much as `new`, each other tenant its weight's share
    of `new`'s tenant's work, and no prompt more than it has."""
    own = tenants.get(new.tenant)
    own_tenant = new.tokens + (0 if own is None else own.capped(new.tokens))
    return own_tenant + round(
        sum(
            min(work.total, own_tenant * work.weight / new.weight)
            for name, work in tenants.items()
            if name != new.tenant
        )
    )


def refuse_if_late(forecast_s: float, alone_s: float, deadline_s: float, tokens: int) -> None:
    """Refuses at arrival a generation whose first token is predicted `forecast_s` after its
    arrival (`alone_s` with nothing ahead of it), past `deadline_s`: 504 where it could not
    make it even alone (a retry cannot help), else 503 with the wait until the work ahead
    leaves room for it."""
    if forecast_s <= deadline_s:
        return
    if alone_s > deadline_s:
        raise PrefillTooLong(
            f"the prompt's {tokens} tokens are predicted to take {alone_s:.1f} s to prefill"
            f" on this model's devices, past its first-token deadline of {deadline_s:.1f} s:"
            " shorten the prompt or give a longer timeout_ms (up to --first-token-timeout-ms)"
        )
    raise Overloaded(
        f"the first token is predicted in {forecast_s:.1f} s behind the prefill ahead of it,"
        f" past its deadline of {deadline_s:.1f} s",
        retry_after_s=max(1.0, math.ceil(forecast_s - deadline_s)),
    )
