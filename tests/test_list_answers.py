"""A list's parts waited for together (engine/list_answers.py): results in the order given,
each part settled once, as it is answered, with its own outcome; the first failure by
position raised once all are done; a waiter that leaves settles the rest as left and keeps
what was answered; and no task a part (10,000 tasks stalled the loop ~30 ms)."""

from __future__ import annotations

import asyncio

import pytest

from batchserve.batching.request import QueuedRequest, Result
from batchserve.clock import Timer
from batchserve.engine.list_answers import all_answers
from batchserve.errors import BatchserveError, DeadlineExceeded

from .conftest import PLAIN_KEY

Settled = list[tuple[str, Result | BatchserveError | None]]


def parts(count: int) -> list[tuple[QueuedRequest, Timer | None]]:
    loop = asyncio.get_running_loop()
    return [
        (QueuedRequest(f"r.{i}", f"in-{i}", 0.0, 10.0, loop.create_future(), PLAIN_KEY), None)
        for i in range(count)
    ]


def recorder(settled: Settled):  # type: ignore[no-untyped-def]
    def settle(request: QueuedRequest, _: Timer | None, outcome: object) -> None:
        settled.append((request.request_id, outcome))  # type: ignore[arg-type]

    return settle


def result(text: str) -> Result:
    return Result(text, 0.0, 0.0, 1, 0, "sim:0")


async def test_results_come_in_order_each_settled_once_as_it_is_answered() -> None:
    admitted, settled = parts(3), []
    waiter = asyncio.ensure_future(all_answers(admitted, recorder(settled)))
    await asyncio.sleep(0)  # it waits
    for index in (2, 0, 1):  # answered out of order
        admitted[index][0].future.set_result(result(f"out-{index}"))
        await asyncio.sleep(0)
        assert settled[-1] == (f"r.{index}", result(f"out-{index}"))
    outputs = [r.output for r in await waiter]
    assert outputs == ["out-0", "out-1", "out-2"]
    assert [name for name, _ in settled] == ["r.2", "r.0", "r.1"]


async def test_the_first_failure_by_position_is_raised_once_all_are_done() -> None:
    admitted, settled = parts(3), []
    waiter = asyncio.ensure_future(all_answers(admitted, recorder(settled)))
    late, early = DeadlineExceeded("second"), DeadlineExceeded("third")
    admitted[2][0].future.set_exception(early)
    admitted[1][0].future.set_exception(late)
    await asyncio.sleep(0)
    assert not waiter.done()  # the first part is still out
    admitted[0][0].future.set_result(result("out-0"))
    with pytest.raises(DeadlineExceeded, match="second"):
        await waiter
    assert dict(settled) == {"r.0": result("out-0"), "r.1": late, "r.2": early}


async def test_a_waiter_that_leaves_settles_the_rest_as_left_and_keeps_the_answered() -> None:
    admitted, settled = parts(3), []
    waiter = asyncio.ensure_future(all_answers(admitted, recorder(settled)))
    admitted[1][0].future.set_result(result("out-1"))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.sleep(0)  # the cancelled parts' callbacks
    assert dict(settled) == {"r.1": result("out-1"), "r.0": None, "r.2": None}
    assert len(settled) == 3
    assert admitted[0][0].future.cancelled()
    assert admitted[2][0].future.cancelled()


async def test_an_empty_list_answers_at_once() -> None:
    assert await all_answers([], recorder([])) == []


async def test_no_task_a_part() -> None:
    admitted, settled = parts(1000), []
    before = len(asyncio.all_tasks())
    waiter = asyncio.ensure_future(all_answers(admitted, recorder(settled)))
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before + 1  # the waiter alone
    for request, _ in admitted:
        request.future.set_result(result(request.input))
    assert [r.output for r in await waiter] == [f"in-{i}" for i in range(1000)]
    assert len(settled) == 1000
