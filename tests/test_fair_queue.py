"""Batch order by tier and fairness between tenants, with time passed in."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchserve.batching.request import QueuedRequest
from batchserve.rules.fair_queue import FairQueue, predicted_wait_s
from batchserve.rules.tenants import TIER_RANKS

from .conftest import PLAIN_KEY


def request(name: str, tenant: str, tier: str, arrival: float = 0.0) -> QueuedRequest:
    queued = QueuedRequest(name, name, arrival, arrival + 5.0, None, PLAIN_KEY)  # type: ignore[arg-type]
    queued.tenant, queued.tier_rank = tenant, TIER_RANKS[tier]
    return queued


def names(batch: list[QueuedRequest]) -> list[str]:
    return [r.request_id for r in batch]


def test_higher_tiers_first_and_tenants_take_turns_within_a_tier():
    queue = FairQueue()
    for r in [
        request("a1", "a", "free"), request("a2", "a", "free"), request("a3", "a", "free"),
        request("b1", "b", "paid"), request("b2", "b", "paid"),
        request("c1", "c", "enterprise"),
        request("d1", "d", "free"),
        request("e1", "e", "enterprise"), request("e2", "e", "enterprise"),
    ]:  # fmt: skip
        queue.push(r)
    assert names(queue.take(5)) == ["c1", "e1", "e2", "b1", "b2"]
    assert names(queue.take(10)) == ["a1", "d1", "a2", "a3"]
    assert len(queue) == 0


def test_one_tenants_requests_in_two_tiers_each_wait_in_their_own():
    # The inference gateway's objective header gives each request its tier: a tenant's
    # critical request must not queue at the rank of its sheddable one that came first.
    queue = FairQueue()
    for r in [request("gw-free", "gateway", "free", 0.0), request("other", "o", "paid", 0.1),
              request("gw-ent", "gateway", "enterprise", 0.2)]:  # fmt: skip
        queue.push(r)
    assert names(queue.take(3)) == ["gw-ent", "other", "gw-free"]
    assert len(queue) == 0
    queue.push(request("again", "gateway", "paid"))
    assert queue.only("gateway")
    assert not queue.only("o")
    assert queue.discard(queue.head(1)[0])
    assert len(queue) == 0


@given(
    flood=st.integers(1, 3000), batch=st.integers(2, 100), tier=st.sampled_from(list(TIER_RANKS))
)
def test_a_flooding_tenant_never_pushes_another_tenant_out_of_the_next_batch(flood, batch, tier):
    queue = FairQueue()
    for n in range(flood):
        queue.push(request(f"f{n}", "flooder", tier))
    queue.push(request("quiet", "quiet", tier))
    assert "quiet" in names(queue.take(batch))


def test_lower_tiers_age_upward_and_are_never_starved():
    queue = FairQueue(aging_s=1.0)
    queue.push(request("free", "f", "free", arrival=0.0))  # priority time 0 + 2 x 1 s
    queue.push(request("paid", "p", "paid", arrival=0.5))  # 0.5 + 1 s
    for n in range(3):
        queue.push(request(f"ent{n}", "e", "enterprise", arrival=1.0 + n))
    assert names(queue.take(10)) == ["ent0", "paid", "ent1", "free", "ent2"]


def test_discard_removes_a_request_and_a_tenant_with_nothing_left():
    queue = FairQueue()
    x = request("x", "t", "paid")
    queue.push(x)
    queue.push(request("y", "u", "paid"))
    assert queue.discard(x)
    assert not queue.discard(request("x", "t", "paid"))  # the same id, another request
    assert names(queue.take(10)) == ["y"]
    assert queue.ahead_of("t", TIER_RANKS["paid"]) == 0


def test_what_is_ahead_of_a_new_request_decides_who_is_shed_first():
    queue = FairQueue()
    for n in range(50):
        queue.push(request(f"f{n}", "flooder", "free"))
    for n in range(10):
        queue.push(request(f"p{n}", "payer", "paid"))
    queue.push(request("e0", "ent", "enterprise"))
    assert queue.ahead_of("ent", TIER_RANKS["enterprise"]) == 1
    assert queue.ahead_of("newcomer", TIER_RANKS["paid"]) == 1 + 1  # one turn of the payer
    assert queue.ahead_of("quiet", TIER_RANKS["free"]) == 1 + 10 + 1
    assert queue.ahead_of("flooder", TIER_RANKS["free"]) == 1 + 10 + 50
    assert predicted_wait_s(61, capacity_rps=100.0, call_s=0.1) == pytest.approx(0.71)
    assert predicted_wait_s(61, capacity_rps=0.0, call_s=0.1) == math.inf  # nothing left


def weighted(name: str, tenant: str, weight: float) -> QueuedRequest:
    queued = request(name, tenant, "paid")
    queued.tenant_weight = weight
    return queued


def test_tenants_share_their_tier_in_proportion_to_their_weights():
    queue = FairQueue()
    for n in range(6):
        queue.push(weighted(f"a{n}", "a", 2.0))
        queue.push(weighted(f"b{n}", "b", 1.0))
    assert names(queue.take(6)) == ["a0", "a1", "b0", "a2", "a3", "b1"]
    half = FairQueue()
    for n in range(6):
        half.push(weighted(f"c{n}", "c", 0.5))
        half.push(weighted(f"d{n}", "d", 1.0))
    taken = names(half.take(6))
    assert sum(name.startswith("d") for name in taken) == 4  # twice c's turns
    assert half.ahead_of("new", TIER_RANKS["paid"], weight=1.0) == 1 + 1  # one turn each


def test_a_sole_tenant_is_first_in_first_out_and_then_shares_like_any_other():
    queue = FairQueue()
    for n in range(5):
        queue.push(weighted(f"a{n}", "a", 2.0))
    assert names(queue.take(3)) == ["a0", "a1", "a2"]
    queue.push(weighted("b0", "b", 1.0))
    queue.push(weighted("b1", "b", 1.0))
    # Its round over, "a" starts the next with no credit: two turns for its weight, then b.
    assert names(queue.take(3)) == ["a3", "a4", "b0"]
    assert names(queue.take(5)) == ["b1"]
    assert (len(queue), queue.weight) == (0, 0.0)
    queue.push(weighted("c0", "c", 3.0))
    assert (names(queue.take(2)), queue.weight) == (["c0"], 0.0)
