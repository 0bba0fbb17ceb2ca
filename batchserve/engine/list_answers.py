"""A list's parts waited for together: one done-callback a part, not one task a part.

`Engine.infer_all` admits a list's parts in one pass, then waits for all of them. Awaited as
one task a part (`asyncio.gather`), a 10,000-input /embed started 10,000 tasks whose first
steps all ran in the loop's next pass: about 30 ms in which no other request, stream or
probe was served. A callback on each part's future settles it as it is answered (what the
task's `finally` did) and counts it; the last one wakes the list's one waiter. A waiter
cancelled (its client left) cancels the parts not yet answered, whose callbacks then settle
them as left; those answered already keep their outcome.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence

from ..batching.request import QueuedRequest, Result
from ..clock import Timer
from ..errors import BatchserveError

Settle = Callable[[QueuedRequest, Timer | None, Result | BatchserveError | None], None]
"""The engine's `settle` for one part: its request, its own timer, and its outcome (None:
left unanswered)."""


async def all_answers(
    admitted: Sequence[tuple[QueuedRequest, Timer | None]], settle: Settle
) -> list[Result]:
    """The parts' results in the order given once every part is done, each settled as it is
    answered; raises the error of the first part (by position) that failed."""
    if not admitted:
        return []
    left = len(admitted)
    everyone = asyncio.get_running_loop().create_future()

    def answered(
        request: QueuedRequest, expiry: Timer | None, future: asyncio.Future[Result]
    ) -> None:
        nonlocal left
        settle(request, expiry, _outcome(future))
        left -= 1
        if left == 0 and not everyone.done():
            everyone.set_result(None)

    for request, expiry in admitted:
        request.future.add_done_callback(functools.partial(answered, request, expiry))
    try:
        await everyone
    except asyncio.CancelledError:
        for request, _ in admitted:
            request.future.cancel()  # a no-op for those answered already
        raise
    results: list[Result] = []
    for request, _ in admitted:
        error = request.future.exception()
        if error is not None:
            raise error
        results.append(request.future.result())
    return results


def _outcome(future: asyncio.Future[Result]) -> Result | BatchserveError | None:
    """What a part's future ended with, as `settle` records it: its result, its error, or None
    (cancelled, or an error that is not an answer)."""
    if future.cancelled():
        return None
    error = future.exception()
    if error is None:
        return future.result()
    return error if isinstance(error, BatchserveError) else None
