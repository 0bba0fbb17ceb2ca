"""The pure fault rules: recovery plans (with hypothesis) and the watchdog's budget."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchserve.batching.faults import FailureKind, RetryBudget, plan_recovery
from batchserve.batching.request import QueuedRequest
from batchserve.rules.capacity import CALL_TIME_WEIGHT, BatchBudget, CallTime

from .conftest import PLAIN_KEY


def requests(count: int) -> list[QueuedRequest]:
    loop = asyncio.new_event_loop()
    try:
        return [
            QueuedRequest(f"r{n}", f"in-{n}", 0.0, 10.0, loop.create_future(), PLAIN_KEY)
            for n in range(count)
        ]
    finally:
        loop.close()


def test_a_raised_batch_is_halved_in_order():
    batch = requests(5)
    recovery = plan_recovery(batch, FailureKind.RAISED, bisect=True, budget=RetryBudget())
    assert recovery.retry == [batch[:2], batch[2:]]
    assert recovery.fail == []


def test_a_raised_single_request_or_no_bisection_fails_everyone():
    one = requests(1)
    assert plan_recovery(one, FailureKind.RAISED, bisect=True, budget=RetryBudget()).fail == one
    batch = requests(4)
    recovery = plan_recovery(batch, FailureKind.RAISED, bisect=False, budget=RetryBudget())
    assert (recovery.retry, recovery.fail) == ([], batch)


@pytest.mark.parametrize("kind", [FailureKind.MALFORMED, FailureKind.HUNG])
def test_malformed_and_hung_batches_run_again_once_whole(kind):
    batch = requests(3)
    first = plan_recovery(batch, kind, bisect=True, budget=RetryBudget())
    assert (first.retry, first.fail) == ([batch], [])
    second = plan_recovery(batch, kind, bisect=True, budget=RetryBudget())
    assert (second.retry, second.fail) == ([], batch)


def test_a_hang_retry_does_not_spend_the_malformed_retry():
    batch = requests(2)
    plan_recovery(batch, FailureKind.HUNG, bisect=True, budget=RetryBudget())
    recovery = plan_recovery(batch, FailureKind.MALFORMED, bisect=True, budget=RetryBudget())
    assert recovery.retry == [batch]


@given(
    size=st.integers(1, 100),
    poison=st.sets(st.integers(0, 99), max_size=5),
)
def test_bisection_fails_exactly_the_poison_inputs_in_bounded_calls(size, poison):
    """Drives the plan as the batcher would: a call raises iff it holds a poison input."""
    poison = {index for index in poison if index < size}
    batch = requests(size)
    position = {id(request): n for n, request in enumerate(batch)}
    pending, succeeded, failed, calls = [batch], [], [], 0
    unlimited = RetryBudget(tokens=math.inf, reserve=math.inf)
    while pending:
        group = pending.pop()
        calls += 1
        if not any(position[id(r)] in poison for r in group):
            succeeded += group
            continue
        recovery = plan_recovery(group, FailureKind.RAISED, bisect=True, budget=unlimited)
        pending += recovery.retry
        failed += recovery.fail
    assert {position[id(r)] for r in failed} == poison
    assert len(succeeded) + len(failed) == size
    assert len({id(r) for r in succeeded + failed}) == size  # each ends exactly once
    rounds = math.ceil(math.log2(size)) if size > 1 else 0
    assert calls <= 1 + 2 * rounds * max(1, len(poison))


def test_the_retry_budget_pays_for_parts_until_spent_then_they_wait_for_spare_time():
    budget = RetryBudget(ratio=0.5, reserve=3.0, tokens=3.0)
    assert plan_recovery(requests(4), FailureKind.RAISED, bisect=True, budget=budget).retry
    spent = plan_recovery(requests(4), FailureKind.RAISED, bisect=True, budget=budget)
    assert (spent.retry, spent.fail, [len(g) for g in spent.spare]) == ([], [], [2, 2])
    malformed = plan_recovery(requests(2), FailureKind.MALFORMED, bisect=True, budget=budget)
    assert malformed.retry
    assert budget.tokens == 0
    unpaid = plan_recovery(requests(2), FailureKind.MALFORMED, bisect=True, budget=budget)
    assert (unpaid.retry, unpaid.fail, len(unpaid.spare)) == ([], [], 1)
    hung = requests(2)
    assert plan_recovery(hung, FailureKind.HUNG, bisect=True, budget=budget).retry == [hung]
    failing = requests(2)
    recovery = plan_recovery(failing, FailureKind.DEVICE_FAILING, bisect=True, budget=budget)
    assert recovery.retry == [failing]  # the device's fault: whole, once, unpaid
    suspect = requests(4)
    moved = plan_recovery(suspect, FailureKind.SUSPECT_DEVICE, bisect=True, budget=budget)
    assert (moved.retry, all(r.moved for r in suspect)) == ([suspect], True)
    again = plan_recovery(suspect, FailureKind.SUSPECT_DEVICE, bisect=True, budget=budget)
    assert [len(g) for g in again.spare] == [2, 2]  # failed elsewhere too: split, as raised
    for _ in range(100):
        budget.on_first_try()
    assert budget.tokens == 3.0  # refills by `ratio` a first try, up to the reserve


@pytest.mark.parametrize(
    ("size", "parts", "sizes"),
    [(99, 2, [49, 50]), (8, 4, [2, 2, 2, 2]), (10, 4, [2, 2, 3, 3]), (3, 8, [1, 1, 1]),
     (5, 0, [2, 3])],
)  # fmt: skip
def test_a_raised_batch_splits_in_order_into_one_part_per_free_device(size, parts, sizes):
    batch = requests(size)
    recovery = plan_recovery(
        batch, FailureKind.RAISED, bisect=True, budget=RetryBudget(), parts=parts
    )
    assert [len(group) for group in recovery.retry] == sizes
    assert [r for group in recovery.retry for r in group] == batch
    assert len(recovery.retry) <= RetryBudget().tokens  # paid one call a part


def test_a_lone_input_failed_on_one_device_runs_once_more_before_it_counts_as_poison():
    [request] = one = requests(1)
    budget = RetryBudget()
    first = plan_recovery(one, FailureKind.RAISED, bisect=True, budget=budget, unproven=True)
    assert (first.retry, first.fail) == ([one], [])
    assert request.device_retried
    again = plan_recovery(one, FailureKind.RAISED, bisect=True, budget=budget, unproven=True)
    assert (again.retry, again.fail) == ([], one)
    proven = plan_recovery(requests(1), FailureKind.RAISED, bisect=True, budget=budget)
    assert proven.retry == []


def test_a_given_budget_is_used_as_it_is():
    assert BatchBudget(fixed_s=0.25).seconds(9.0) == 0.25


def test_a_derived_budget_follows_the_predicted_call_above_its_floor():
    budget = BatchBudget(multiple=5.0, floor_s=1.0, unknown_s=10.0)
    assert budget.seconds(None) == 10.0  # nothing seen yet: first calls may warm up
    assert budget.seconds(0.1) == 1.0  # 5 x 100 ms is under the floor
    assert budget.seconds(2.0) == 10.0


def test_the_call_time_is_one_moving_average_of_successful_calls():
    call_time = CallTime()
    assert call_time.seconds is None
    call_time.observe(0.1)
    assert call_time.seconds == 0.1  # the first call is taken as it is
    call_time.observe(0.2)
    assert call_time.seconds == pytest.approx(0.1 + CALL_TIME_WEIGHT * 0.1)
