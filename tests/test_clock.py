"""The fake clock that the engine's tests drive, and the two waits built on any clock."""

from __future__ import annotations

import asyncio

import pytest

from batchserve.clock import FakeClock, LoopClock, sleep_until, wait_until


def test_timers_fire_in_time_order_with_the_clock_at_their_time():
    clock = FakeClock(start=0.0)
    fired: list[tuple[str, float]] = []
    clock.call_at(2.0, lambda: fired.append(("b", clock.time())))
    clock.call_at(1.0, lambda: fired.append(("a", clock.time())))
    cancelled = clock.call_at(1.5, lambda: fired.append(("never", clock.time())))
    cancelled.cancel()
    clock.advance(1.0)
    assert fired == [("a", 1.0)]
    assert clock.next_timer() == 2.0
    clock.advance(5.0)
    assert fired == [("a", 1.0), ("b", 2.0)]
    assert clock.time() == 6.0
    assert clock.next_timer() is None


async def test_sleep_until_returns_only_when_the_clock_gets_there():
    clock = FakeClock(start=0.0)
    sleeper = asyncio.ensure_future(sleep_until(clock, 3.0))
    await asyncio.sleep(0)
    clock.advance(2.9)
    await asyncio.sleep(0)
    assert not sleeper.done()
    clock.advance(0.1)
    await sleeper


async def test_wait_until_says_whether_the_future_finished_in_time_and_never_cancels_it():
    clock = FakeClock(start=0.0)
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(wait_until(clock, future, 1.0))
    await asyncio.sleep(0)
    clock.advance(1.0)
    assert await waiting is False
    assert not future.cancelled()
    waiting = asyncio.ensure_future(wait_until(clock, future, 2.0))
    await asyncio.sleep(0)
    future.set_result(7)
    assert await waiting is True


async def test_a_timer_armed_for_a_time_already_past_runs_on_the_next_loop_pass():
    clock = FakeClock(start=5.0)
    fired: list[float] = []
    clock.call_at(4.0, lambda: fired.append(clock.time()))
    assert fired == []
    await asyncio.sleep(0)
    assert fired == [5.0]


async def test_the_loop_clock_is_the_running_loops_once_attached_and_refuses_before():
    clock = LoopClock()
    with pytest.raises(RuntimeError, match="once the engine has started"):
        clock.time()
    loop = asyncio.get_running_loop()
    clock.attach(loop)
    fired = asyncio.Event()
    clock.call_at(clock.time(), fired.set)
    await fired.wait()
    assert clock.time() <= loop.time()
