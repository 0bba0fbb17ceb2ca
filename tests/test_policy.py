"""The batching decision on plain numbers: each flush rule, then properties over any input."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from batchserve.rules.capacity import CallTime
from batchserve.rules.policy import SPACING_SHARE, AdaptivePolicy, Decision, FixedPolicy, QueueView

SERVICE = 0.1


def adaptive(max_batch_size: int = 100, max_linger_s: float = 0.05) -> AdaptivePolicy:
    return AdaptivePolicy(
        max_batch_size=max_batch_size, max_linger_s=max_linger_s, call_time=timed(SERVICE)
    )


def timed(seconds: float) -> CallTime:
    """The engine's batch-time estimate after one call of `seconds`."""
    call_time = CallTime()
    call_time.observe(seconds)
    return call_time


def queue(size: int, oldest: float = 0.0, deadline: float = math.inf) -> QueueView:
    return QueueView(size=size, oldest_arrival=oldest, earliest_deadline=deadline)


def test_nothing_leaves_without_a_request_or_a_free_device():
    policy = adaptive()
    assert policy.decide(1.0, QueueView(0), 4, []) == Decision(0)
    assert policy.decide(1.0, queue(50), 0, [0.9] * 4) == Decision(0)


def test_a_full_batch_leaves_at_once_and_no_bigger():
    assert adaptive(max_batch_size=8).decide(1.0, queue(30, 1.0), 1, [0.99]) == Decision(8)


def test_a_partial_batch_leaves_at_once_when_the_last_start_is_a_spacing_ago():
    # Four devices, 100 ms batches: starts 25 ms apart keep them evenly spread.
    assert adaptive().decide(1.0, queue(3, 1.0), 2, [0.95, 0.975]) == Decision(3)
    assert adaptive().decide(1.0, queue(3, 1.0), 3, [0.9]) == Decision(3)


def test_each_batch_that_leaves_says_why():
    """The reason a batch's trace span carries; not part of the decision's value."""
    assert adaptive(max_batch_size=8).decide(1.0, queue(30, 1.0), 1, [0.99]).reason == "full"
    assert adaptive().decide(1.0, queue(1, 1.0), 1, []).reason == "idle"  # no device busy
    untimed = AdaptivePolicy(max_batch_size=100, max_linger_s=0.05, call_time=CallTime())
    assert untimed.decide(1.0, queue(1, 1.0), 1, [0.99]).reason == "idle"  # nothing measured
    assert adaptive().decide(1.0, queue(3, 1.0), 3, [0.9]).reason == "spacing"
    assert adaptive().decide(1.0, queue(2, 0.95), 1, [0.99]).reason == "linger"
    due = adaptive().decide(1.0, queue(1, 1.0, deadline=1.1), 1, [0.99])
    assert due.reason == "deadline"
    assert due == Decision(1, reason="full")  # the reason is not compared
    fixed = FixedPolicy(max_batch_size=32, max_linger_s=0.05)
    assert fixed.decide(1.05, queue(5, 1.0), 4, []).reason == "linger"
    assert fixed.decide(1.0, queue(40, 1.0), 4, []).reason == "full"


def test_a_partial_batch_waits_a_spacing_after_the_last_start_even_with_devices_free():
    # Three free, one started at 0.99: sending now would start two devices 10 ms apart.
    decision = adaptive().decide(1.0, queue(1, 1.0), 3, [0.99])
    assert decision.dispatch == 0
    assert decision.wake_at is not None
    assert math.isclose(decision.wake_at, 0.99 + SPACING_SHARE * SERVICE / 4)


def test_spacing_counts_only_the_devices_that_run():
    # Two devices in all (one free, one busy since 0.96): starts about 50 ms apart.
    decision = adaptive().decide(1.0, queue(1, 1.0), 1, [0.96])
    assert decision.wake_at is not None
    assert math.isclose(decision.wake_at, 0.96 + SPACING_SHARE * SERVICE / 2)


def test_a_queue_spaces_its_batches_over_its_share_of_shared_devices():
    # Four devices, one busy with this queue's batch since 0.97. Alone it would send now
    # (25 ms spacing); with a 5 % share (0.2 of the devices, counted as one) it waits for
    # the spacing of one device, and with 2 of the 4 for the spacing of two.
    busy = [0.97]
    assert adaptive().decide(1.0, queue(3, 1.0), 3, busy) == Decision(3)
    for share, devices in ((0.2, 1), (2.0, 2)):
        view = QueueView(size=3, oldest_arrival=1.0, device_share=share)
        decision = adaptive(max_linger_s=1.0).decide(1.0, view, 3, busy)
        assert decision == Decision(0, 0.97 + SPACING_SHARE * SERVICE / devices)
    # A share above the devices there are changes nothing.
    view = QueueView(size=3, oldest_arrival=1.0, device_share=9.0)
    assert adaptive().decide(1.0, view, 3, busy) == Decision(3)


def test_a_lone_device_never_holds():
    assert adaptive().decide(1.0, queue(1, 1.0), 1, []) == Decision(1)


def test_before_any_batch_is_timed_the_policy_is_greedy():
    policy = AdaptivePolicy(max_batch_size=100, max_linger_s=0.05, call_time=CallTime())
    assert policy.decide(1.0, queue(1, 1.0), 1, [0.99]) == Decision(1)


def test_hold_ends_at_the_linger_budget():
    decision = adaptive(max_linger_s=0.01).decide(1.0, queue(1, 0.995), 1, [0.99])
    assert decision.wake_at is not None
    assert math.isclose(decision.wake_at, 1.005)


def test_linger_spent_sends_the_batch():
    assert adaptive(max_linger_s=0.01).decide(1.011, queue(2, 1.0), 1, [1.0]) == Decision(2)


def test_hold_leaves_a_batch_time_before_the_earliest_deadline():
    decision = adaptive().decide(1.0, queue(1, 1.0, deadline=1.105), 1, [0.99])
    assert decision.wake_at is not None
    assert math.isclose(decision.wake_at, 1.005)
    assert adaptive().decide(1.0, queue(1, 1.0, deadline=1.1), 1, [0.99]) == Decision(1)


def test_spacing_follows_the_engine_s_batch_time_estimate():
    call_time = timed(SERVICE)
    policy = AdaptivePolicy(max_batch_size=100, max_linger_s=1.0, call_time=call_time)
    for _ in range(50):
        call_time.observe(0.2)
    decision = policy.decide(1.0, queue(1, 1.0), 1, [0.99])
    assert decision.wake_at is not None
    assert math.isclose(decision.wake_at, 0.99 + SPACING_SHARE * 0.2 / 2, rel_tol=1e-3)


def test_fixed_waits_for_size_or_linger_then_a_free_device():
    policy = FixedPolicy(max_batch_size=32, max_linger_s=0.05)
    assert policy.decide(1.0, queue(5, 1.0), 4, []) == Decision(0, 1.05)
    assert policy.decide(1.05, queue(5, 1.0), 4, []) == Decision(5)
    assert policy.decide(1.0, queue(40, 1.0), 4, []) == Decision(32)
    assert policy.decide(1.2, queue(40, 1.0), 0, [1.0] * 4) == Decision(0)


busy_lists = st.lists(st.floats(0.0, 10.0), max_size=16)


@given(
    now=st.floats(0.0, 10.0),
    size=st.integers(0, 500),
    age=st.floats(0.0, 1.0),
    slack=st.floats(-1.0, 10.0),
    free=st.integers(0, 16),
    busy=busy_lists,
    max_batch=st.integers(1, 100),
    linger=st.floats(0.0, 0.2),
    service=st.floats(0.001, 1.0),
)
def test_adaptive_decisions_are_always_sound(
    now, size, age, slack, free, busy, max_batch, linger, service
):
    policy = AdaptivePolicy(max_batch_size=max_batch, max_linger_s=linger, call_time=timed(service))
    view = queue(size, oldest=now - age, deadline=now + slack) if size else QueueView(0)
    busy_since = [min(start, now) for start in busy]
    decision = policy.decide(now, view, free, busy_since)
    assert 0 <= decision.dispatch <= min(size, max_batch)
    if size == 0 or free == 0:
        assert decision.dispatch == 0
    if size and free and size >= max_batch:
        assert decision.dispatch == max_batch
    if decision.dispatch == 0 and size and free:
        # A hold always ends, strictly later, inside the linger budget and before the
        # point where the earliest deadline could no longer be met.
        assert decision.wake_at is not None
        assert now < decision.wake_at <= view.oldest_arrival + linger
        assert decision.wake_at <= view.earliest_deadline - service + 1e-12


@given(
    now=st.floats(0.0, 10.0),
    size=st.integers(1, 500),
    age=st.floats(0.0, 1.0),
    free=st.integers(0, 16),
    max_batch=st.integers(1, 100),
    linger=st.floats(0.0, 0.2),
)
def test_fixed_decisions_are_always_sound(now, size, age, free, max_batch, linger):
    policy = FixedPolicy(max_batch_size=max_batch, max_linger_s=linger)
    decision = policy.decide(now, queue(size, oldest=now - age), free, [])
    assert 0 <= decision.dispatch <= min(size, max_batch)
    due = now - age + linger
    if free and (size >= max_batch or now >= due):
        assert decision.dispatch == min(size, max_batch)
    if decision.dispatch == 0 and decision.wake_at is not None:
        assert decision.wake_at > now
