"""Who is calling, and how fast they may: API keys, tenants, tiers and token buckets.

`--keys-file` is TOML:

    [keys."sk-ent-123"]
    tenant = "acme"
    tier = "enterprise"          # free | paid | enterprise
    weight = 2.0                 # optional: twice the turns of its tier's other tenants
    role = "operator"            # optional: may also read /metrics, /api/stats (dashboard)

    [tiers.free]                 # optional; these override the defaults below
    share = 0.01                 # each tenant's rate: this share of the live capacity x 0.75
    rate = 5.0                   # or a fixed rate, requests a second (pins it)
    burst = 10.0                 # requests at once
    timeout_ms = 2000            # the tier's deadline (capped by --timeout-ms)

Keys are looked up by their SHA-256 digest and then compared with `hmac.compare_digest`, so
the time taken does not depend on how much of a key matches; they are never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import StartupError

TIERS = ("free", "paid", "enterprise")
"""The tiers, lowest to highest: the one list of them (keys files, rates, batch order)."""
TIER_RANKS = {tier: rank for rank, tier in enumerate(reversed(TIERS))}
"""Each tier's place in the batch order (rules/fair_queue.py): lower goes first, so
enterprise is 0. Requests without a tier rank with enterprise (the server is open)."""
IDLE_RANK = len(TIERS)
"""The Batch API's lines (doors/batch_runner.py): below every tier, and never aged into one;
they take only what online requests leave idle (rules/fair_queue.py, batching/idle.py)."""
ROLES = ("tenant", "operator")


RATE_UTILIZATION = 0.75
"""Tier shares are of this part of the live capacity: headroom for bursts and estimates."""


@dataclass(frozen=True, slots=True)
class TierLimits:
    share: float
    burst: float
    rate: float | None = None
    """A fixed rate; None: `share` of the live capacity."""
    timeout_ms: float | None = None

    def rate_at(self, capacity_rps: float | None) -> float:
        """Each tenant's requests a second: pinned, else its share of what the healthy
        devices can take now (so a hung or failing device lowers it at once), else, before
        any batch has measured the capacity, one burst a second."""
        if self.rate is not None:
            return self.rate
        if capacity_rps is None:
            return self.burst
        return self.share * RATE_UTILIZATION * capacity_rps


DEFAULT_LIMITS = {
    "free": TierLimits(share=0.01, burst=10.0),
    "paid": TierLimits(share=0.1, burst=100.0),
    "enterprise": TierLimits(share=1.0, burst=1000.0),
}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    tier: str
    weight: float = 1.0
    """Its share of the turns among the tenants of its tier."""
    operator: bool = False
    """May read the server's numbers: /metrics, /api/stats (the dashboard's)."""
    timeout_cap_ms: float | None = None
    """A cap on this request's deadline: the gateway's x-slo-ttft-ms (gateway.py)."""
    ids_of: str | None = None
    """Whose request ids these are where not this tenant's alone: the caller behind a
    tenant the gateway shares between fairness ids (gateway.py)."""
    idle: bool = False
    """Runs a Batch API line for this tenant: in IDLE_RANK, spending none of its rate."""

    @property
    def rank(self) -> int:
        """Its tier's place in the batch order: see TIER_RANKS (IDLE_RANK for a batch line)."""
        return IDLE_RANK if self.idle else TIER_RANKS[self.tier]

    @property
    def id_scope(self) -> str:
        """The namespace of its request ids (in flight, in the status API): its name, or
        the caller's own where the tenant is shared."""
        return self.name if self.ids_of is None else self.ids_of


ANONYMOUS = "anonymous"


@dataclass(slots=True)
class TokenBucket:
    """`rate` tokens a second up to `burst`; time is passed in."""

    rate: float
    burst: float
    tokens: float
    updated: float

    def refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, now: float, count: int = 1) -> float:
        """Takes `count` tokens at once, or none; returns 0, or the seconds until they will
        be there (never, for more than the burst: the caller refuses those first)."""
        self.refill(now)
        if self.tokens >= count:
            self.tokens -= count
            return 0.0
        if count > self.burst or self.rate <= 0:
            return math.inf
        return (count - self.tokens) / self.rate

    def seconds_to_full(self) -> float:
        return (self.burst - self.tokens) / self.rate if self.rate > 0 else math.inf


def bearer_secret(authorization: str | None) -> bytes | None:
    """The key of `Authorization: Bearer <key>` as the bytes the client sent; None for no
    header or another scheme. aiohttp decodes header bytes that are not UTF-8 to lone
    surrogates, which `surrogateescape` turns back into those bytes: such a key is only
    unknown, never an error. Every check of a key reads it here."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip().encode("utf-8", "surrogateescape")


@dataclass
class KeyRing:
    tenants_by_digest: dict[bytes, tuple[bytes, Tenant]]
    limits: dict[str, TierLimits]
    anonymous: Tenant | None = None
    _buckets: dict[str, TokenBucket] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str, anonymous_tier: str | None) -> KeyRing:
        try:
            text = Path(path).read_text()
            data = tomllib.loads(text)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise StartupError(f"--keys-file {path}: {exc}") from None
        limits = dict(DEFAULT_LIMITS)
        for tier, settings in data.get("tiers", {}).items():
            if tier not in TIERS:
                raise StartupError(f"--keys-file {path}: unknown tier {tier!r} in [tiers]")
            try:
                limits[tier] = replace(limits[tier], **settings)
            except TypeError:
                raise StartupError(
                    f"--keys-file {path}: [tiers.{tier}] takes share, rate, burst and timeout_ms"
                ) from None
            if not limits[tier].share > 0 or (limits[tier].rate or 1) <= 0:
                raise StartupError(f"--keys-file {path}: [tiers.{tier}] share and rate must be > 0")
        tenants: dict[bytes, tuple[bytes, Tenant]] = {}
        for number, (key, entry) in enumerate(data.get("keys", {}).items(), start=1):
            tier = entry.get("tier")
            weight = entry.get("weight", 1.0)
            role = entry.get("role", "tenant")
            if (
                not isinstance(entry.get("tenant"), str)
                or tier not in TIERS
                or isinstance(weight, bool)
                or not isinstance(weight, int | float)
                or not weight > 0
                or role not in ROLES
            ):
                # The key itself is never printed: the message names its position.
                raise StartupError(
                    f"--keys-file {path}: key number {number} needs a string tenant, a tier"
                    f" of {', '.join(TIERS)} and, if any, a weight above 0 and a role of"
                    f" {' or '.join(ROLES)}"
                )
            if entry["tenant"] == ANONYMOUS:
                raise StartupError(
                    f"--keys-file {path}: {_where_tenant(text, number)}: the tenant name"
                    f" {ANONYMOUS!r} is reserved for requests without a key (--anonymous-tier)"
                )
            secret = key.encode()
            tenants[hashlib.sha256(secret).digest()] = (
                secret,
                Tenant(entry["tenant"], tier, float(weight), operator=role == "operator"),
            )
        if anonymous_tier is not None and anonymous_tier not in TIERS:
            raise StartupError(f"--anonymous-tier must be one of {', '.join(TIERS)}")
        anonymous = Tenant(ANONYMOUS, anonymous_tier) if anonymous_tier else None
        return cls(tenants, limits, anonymous)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant behind `Authorization: Bearer <key>`, the anonymous one, or None."""
        secret = bearer_secret(authorization)
        if not secret:
            return self.anonymous
        found = self.tenants_by_digest.get(hashlib.sha256(secret).digest())
        if found is None or not hmac.compare_digest(found[0], secret):
            return self.anonymous
        return found[1]

    def by_name(self) -> dict[str, Tenant]:
        """Each tenant by name (the first key's, for a tenant with several keys)."""
        named: dict[str, Tenant] = {}
        for _, tenant in self.tenants_by_digest.values():
            named.setdefault(tenant.name, tenant)
        return named

    def take(
        self, tenant: Tenant, now: float, capacity_rps: float | None, count: int = 1
    ) -> tuple[float, TokenBucket]:
        """Spends `count` of the tenant's tokens, all or none, at its tier's rate for the
        live capacity: (0 or seconds to wait, the tenant's bucket)."""
        limits = self.limits[tenant.tier]
        rate = limits.rate_at(capacity_rps)
        bucket = self._buckets.get(tenant.name)
        if bucket is None:
            bucket = TokenBucket(rate, limits.burst, limits.burst, now)
            self._buckets[tenant.name] = bucket
        else:
            bucket.refill(now)  # what accrued so far, at the rate it accrued at
            bucket.rate = rate
        return bucket.take(now, count), bucket


_ANONYMOUS_LINE = re.compile(rf"""^\s*tenant\s*=\s*["']{ANONYMOUS}["']""", re.MULTILINE)


def _where_tenant(text: str, number: int) -> str:
    """Where key number `number` names the reserved tenant: its line in the file when a
    `tenant = "anonymous"` line is there to point at (never the key itself)."""
    found = _ANONYMOUS_LINE.search(text)
    if found is None:
        return f"key number {number}"
    return f"line {text.count(chr(10), 0, found.start()) + 1} (key number {number})"
