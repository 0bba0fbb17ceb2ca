"""Deadlines on one timer: each request expires at its own deadline, not before and not
after, whatever order the deadlines come in; answered requests are neither expired nor kept."""

from __future__ import annotations

import asyncio

import pytest

from batchserve.batching.deadlines import MIN_SWEEP, Deadlines
from batchserve.batching.request import QueuedRequest
from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.errors import DeadlineExceeded, InvalidInput
from batchserve.rules.admission import Admission, checked_timeout_ms

from .conftest import PLAIN_KEY


def waiting(name: str, deadline: float) -> QueuedRequest:
    future = asyncio.get_running_loop().create_future()
    return QueuedRequest(name, name, 0.0, deadline, future, PLAIN_KEY)


def expired(requests: list[QueuedRequest]) -> list[str]:
    return [
        r.request_id
        for r in requests
        if r.future.done() and isinstance(r.future.exception(), DeadlineExceeded)
    ]


async def test_each_request_expires_at_its_deadline_in_order_or_not():
    clock = FakeClock(start=0.0)
    deadlines = Deadlines(clock)
    # In order on the one timer; "short" comes after a later deadline, so has its own.
    requests = [waiting("a", 1.0), waiting("b", 2.0), waiting("c", 2.0), waiting("short", 1.5)]
    own = [deadlines.add(request) for request in requests]
    assert own[:3] == [None, None, None]
    assert own[3] is not None
    assert clock.next_timer() == 1.0
    clock.advance(0.999)
    assert expired(requests) == []
    clock.advance(0.001)
    assert expired(requests) == ["a"]
    clock.advance(0.499)
    assert expired(requests) == ["a"]
    clock.advance(0.001)
    assert expired(requests) == ["a", "short"]
    clock.advance(0.5)
    assert expired(requests) == ["a", "b", "c", "short"]
    assert clock.next_timer() is None


async def test_an_answered_request_is_not_expired_and_the_timer_moves_past_it():
    clock = FakeClock(start=0.0)
    deadlines = Deadlines(clock)
    first, second = waiting("first", 1.0), waiting("second", 3.0)
    deadlines.add(first)
    deadlines.add(second)
    first.future.set_result(None)  # type: ignore[arg-type]
    clock.advance(1.0)
    assert not first.future.exception()
    assert clock.next_timer() == 3.0  # armed for the next one still waiting
    second.future.set_result(None)  # type: ignore[arg-type]
    clock.advance(5.0)
    assert expired([first, second]) == []
    assert len(deadlines) == 0


async def test_answered_requests_are_not_kept_behind_one_that_waits():
    # One request waits for its whole (long) timeout while thousands are answered behind
    # it: they leave the deque in sweeps, so it holds little more than what waits.
    clock = FakeClock(start=0.0)
    deadlines = Deadlines(clock)
    stuck = waiting("stuck", 3600.0)
    deadlines.add(stuck)
    for n in range(20 * MIN_SWEEP):
        request = waiting(f"r{n}", 3600.0 + n)
        deadlines.add(request)
        request.future.set_result(None)  # type: ignore[arg-type]
    assert len(deadlines) <= MIN_SWEEP
    clock.advance(3600.0)
    assert expired([stuck]) == ["stuck"]


async def test_close_disarms_the_timer():
    clock = FakeClock(start=0.0)
    deadlines = Deadlines(clock)
    request = waiting("a", 1.0)
    deadlines.add(request)
    deadlines.close()
    clock.advance(2.0)
    assert not request.future.done()
    assert clock.next_timer() is None


@pytest.mark.parametrize("answered_every", [1, 2, 3])
async def test_many_requests_each_expire_exactly_at_their_deadline(answered_every: int):
    # Deadlines out of order now and then, some answered before: every request still
    # waiting is expired exactly when the clock reaches its deadline.
    clock = FakeClock(start=0.0)
    deadlines = Deadlines(clock)
    requests = [waiting(f"r{n}", 1.0 + (n % 7) * 0.25 + n * 0.01) for n in range(200)]
    for n, request in enumerate(requests):
        deadlines.add(request)
        if n % answered_every == 1:
            request.future.set_result(None)  # type: ignore[arg-type]
    times = sorted({r.deadline for r in requests})
    for time in times:
        clock.advance(time - clock.time())
        for request in requests:
            if request.future.done() and request.future.exception() is not None:
                assert request.deadline <= clock.time()
            elif not request.future.done():
                assert request.deadline > clock.time()
    assert clock.next_timer() is None


async def test_a_shorter_deadline_after_an_answered_longer_one_is_not_late():
    # The timer is still armed for the answered request's deadline: the short one must not
    # wait for it.
    clock = FakeClock(start=0.0)
    deadlines = Deadlines(clock)
    long = waiting("long", 10.0)
    deadlines.add(long)
    long.future.set_result(None)  # type: ignore[arg-type]
    short = waiting("short", 1.0)
    deadlines.add(short)
    clock.advance(1.0)
    assert expired([short]) == ["short"]


@pytest.mark.parametrize("given", [0, -5, float("nan"), float("inf"), True, "500"])
def test_one_timeout_rule_refuses_what_no_deadline_can_be_made_of(given: object) -> None:
    # The doors (wire.timeout_ms_of) and the engine (Admission.timeout_s) share this rule.
    with pytest.raises(InvalidInput, match="timeout_ms must be a number above 0"):
        checked_timeout_ms(given)
    with pytest.raises(InvalidInput, match="timeout_ms must be a number above 0"):
        Admission(Config(timeout_ms=2000)).timeout_s(given, None)  # type: ignore[arg-type]


def test_a_timeout_is_capped_by_the_servers() -> None:
    assert checked_timeout_ms(250) == 250.0
    assert Admission(Config(timeout_ms=2000)).timeout_s(250, None) == 0.25
    assert Admission(Config(timeout_ms=2000)).timeout_s(9000, None) == 2.0
    assert Admission(Config(timeout_ms=2000)).timeout_s(None, None) == 2.0
