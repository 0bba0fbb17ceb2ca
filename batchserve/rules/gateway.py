"""The Kubernetes inference gateway's request headers: who is asking, how urgently, by when.

The Gateway API Inference Extension's endpoint picker passes a request's tenant and objective
as headers, and a latency objective of its own. With `--trust-gateway-headers` on (off by
default: a client could otherwise name its own tenant and tier), they decide the request's
tenant before the engine sees it:

| header                            | effect                                                  |
| --------------------------------- | ------------------------------------------------------- |
| `x-gateway-inference-fairness-id` | the tenant: a keys-file tenant of that name, else one   |
|                                   | of `BUCKETS` tenants per tier that the id hashes onto   |
| `x-gateway-inference-objective`   | the tier, by `OBJECTIVE_TIERS` (unknown: unchanged)     |
| `x-slo-ttft-ms`                   | caps the deadline (to the first token, or the answer);  |
|                                   | never raises it                                         |

Who may name a tenant: on a server without keys, the gateway (it is the only way in); with
`--keys-file`, only a caller whose key is an operator's (the gateway's own key): a tenant's
key keeps its tenant whatever the fairness id says, and its objective can only lower its
tier. Ids that no keys file names hash onto a fixed set of tenants, so a new id each request
grows neither the token buckets nor anything else kept per tenant; the metrics label
requests by tier only. Request ids stay each fairness id's own (`Tenant.ids_of`, a digest
of the whole id, whatever its tier): bucket-mates never see each other's requests. A tenant
named by the gateway is never an operator. Pure: headers in, a `Tenant` out.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Mapping
from dataclasses import replace

from ..errors import InvalidInput
from .tenants import TIER_RANKS, TIERS, Tenant

FAIRNESS_ID = "x-gateway-inference-fairness-id"
OBJECTIVE = "x-gateway-inference-objective"
SLO_TTFT_MS = "x-slo-ttft-ms"

OBJECTIVE_TIERS = {
    "critical": "enterprise",
    "standard": "paid",
    "sheddable": "free",
    **{tier: tier for tier in TIERS},
}
"""An objective's tier, matched without case: the inference extension's criticality names
(Critical, Standard, Sheddable) and batchserve's own tier names."""
BUCKETS = 64
"""Tenants per tier that fairness ids no keys file names are spread over."""
GATEWAY_TENANT = "gateway"
"""The tenant of a request that carries an objective or an SLO but no fairness id, on a
server without keys (with keys, its key's tenant)."""
OPEN_TIER = "enterprise"
"""The tier of a gateway tenant on a server without keys, unless its objective says other:
the rank every request has there, so the headers only ever move requests down."""


class GatewayHeaders:
    """Reads the gateway's headers into a tenant; the engine's, built from its keys."""

    def __init__(self, known: Mapping[str, Tenant]) -> None:
        self._known = {name: replace(t, operator=False) for name, t in known.items()}
        """Keys-file tenants by name: a fairness id naming one is that tenant."""
        self._buckets: dict[tuple[str, int], Tenant] = {}
        """The tenants unknown ids hash onto, made as first used (at most 3 x BUCKETS)."""

    def tenant(self, headers: Mapping[str, str], authenticated: Tenant | None) -> Tenant | None:
        """The request's tenant: `authenticated` (its key's, or None without keys) as the
        gateway's headers change it; `authenticated` itself when it sent none of them."""
        fairness_id = headers.get(FAIRNESS_ID)
        objective = headers.get(OBJECTIVE)
        slo = headers.get(SLO_TTFT_MS)
        if fairness_id is None and objective is None and slo is None:
            return authenticated
        trusted = authenticated is None or authenticated.operator
        tier = OBJECTIVE_TIERS.get((objective or "").strip().lower())
        tenant = authenticated
        if fairness_id and trusted:
            tenant = self._known.get(fairness_id)
            if tenant is None:
                base = tier or (authenticated.tier if authenticated else OPEN_TIER)
                tenant = replace(self._bucket(fairness_id, base), ids_of=_ids_of(fairness_id))
        if tenant is None:
            tenant = Tenant(GATEWAY_TENANT, tier or OPEN_TIER)
        elif tier is not None and (trusted or TIER_RANKS[tier] > TIER_RANKS[tenant.tier]):
            tenant = replace(tenant, tier=tier)  # a tenant's own key may only go down
        if slo is not None:
            tenant = replace(tenant, timeout_cap_ms=_slo_ms(slo))
        return tenant

    def _bucket(self, fairness_id: str, tier: str) -> Tenant:
        index = zlib.crc32(fairness_id.encode("utf-8", "surrogateescape")) % BUCKETS
        tenant = self._buckets.get((tier, index))
        if tenant is None:
            tenant = self._buckets[tier, index] = Tenant(f"{GATEWAY_TENANT}:{tier}:{index}", tier)
        return tenant


def _ids_of(fairness_id: str) -> str:
    """The namespace of a fairness id's request ids: bounded in size whatever the header's,
    and apart from the bucket tenants' names (`gateway:<tier>:<n>`)."""
    digest = hashlib.blake2b(fairness_id.encode("utf-8", "surrogateescape"), digest_size=16)
    return f"{GATEWAY_TENANT}:{digest.hexdigest()}"


def _slo_ms(given: str) -> float:
    try:
        slo = float(given)
    except ValueError:
        slo = math.nan
    if not math.isfinite(slo) or slo <= 0:
        raise InvalidInput(f"{SLO_TTFT_MS} must be a number of milliseconds above 0")
    return slo
