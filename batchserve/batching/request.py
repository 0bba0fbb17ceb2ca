"""What travels from the HTTP handler through the batcher to a device, and back."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..clock import Clock, wait_until
from ..errors import BackendError, BatchserveError, DeadlineExceeded
from ..models.registry import Key

ID_HEX_DIGITS = 32
IDS_PER_DRAW = 256
_unused_ids: deque[str] = deque()
os.register_at_fork(after_in_child=_unused_ids.clear)  # a child never reuses its parent's


class Ask(NamedTuple):
    """What one request asks for, as its caller gave it: a door checks its shape
    (`http_io.parse_input`), the engine the rest as it admits it."""

    text: str
    timeout_ms: float | None = None
    """Its own timeout; None: the server's."""
    model: str | None = None
    version: str | None = None
    params: Mapping[str, Any] | None = None


def new_request_id() -> str:
    """Unguessable, since an id is what the status API is polled by: 16 bytes from the OS's
    random source, drawn for IDS_PER_DRAW ids at once (a system call per request showed in
    the server's profile). Taken with one atomic popleft, so no two threads share one."""
    try:
        return _unused_ids.popleft()
    except IndexError:
        digits = os.urandom(ID_HEX_DIGITS // 2 * IDS_PER_DRAW).hex()
        _unused_ids.extend(
            digits[start : start + ID_HEX_DIGITS] for start in range(0, len(digits), ID_HEX_DIGITS)
        )
        return _unused_ids.popleft()


class Result(NamedTuple):
    """A request's answer; a tuple because a batch makes a hundred at once on the loop."""

    output: Any
    """What the batch function returned for this input: a str, or any JSON value."""
    queue_s: float
    compute_s: float
    batch_size: int
    batch_id: int
    device: str
    model: str = "default"
    version: str = "1"


@dataclass(slots=True, eq=False, weakref_slot=True)
class QueuedRequest:
    """One accepted request; its future is resolved exactly once, by whoever gets there first.

    The handler owns the future (it created it and awaits it); the pool or the batcher only
    resolve it, and always check `done()` first, because a timeout or a client disconnect may
    already have cancelled it. The retry flags let a fault send it round again only once.
    """

    request_id: str
    input: str
    arrival: float
    deadline: float
    future: asyncio.Future[Result]
    key: Key
    tokens: int = 1
    """The input's length for cost (tokens, or characters); 1 for flat-cost models."""
    tenant: str = ""
    tier_rank: int = 0
    tenant_weight: float = 1.0
    """Batch order: see rules/fair_queue.py. Without API keys, one tenant at the top rank."""
    malformed_retried: bool = False
    moved: bool = False
    """Ran again on another device for its device's fault (a hang, a failing or suspect
    device): once."""
    device_retried: bool = False
    """Ran alone once more, on another device, before it counted as poison."""
    rider: bool = False
    """Rides, in a rescue group, in the room of a fresh batch: blamed first if it fails."""
    failed_on: tuple[str, ...] = ()
    """The devices its failed calls ran on: a rescue of it prefers another."""
    rescue_round: int = 0
    """How many failed calls it has been in: isolation's rounds, for the chaos numbers."""
    running: bool = False
    """Whether a batch carrying it is on a device now (for the status API). The pool alone
    writes it: set at dispatch, cleared when it hands a failed batch back."""
    part: bool = False
    """One input of a request of several (an embeddings call): its id is apart from the
    ids clients send."""
    batch_span: object = None
    """With tracing on, the span context of the batch call that answered it: its request
    span's one link (observability/tracing.py)."""

    def expire(self) -> None:
        """Answers 504. The one rule for deadlines: the engine's timer calls it at the
        deadline, and a batch formed after the deadline (before the timer ran) leaves it out."""
        if not self.future.done():
            self.future.set_exception(DeadlineExceeded("the request's deadline passed"))


class Ticket:
    """A submitted request: its status now and, awaited, its result (its error raises)."""

    __slots__ = ("_request",)

    def __init__(self, request: QueuedRequest) -> None:
        self._request = request

    def __repr__(self) -> str:
        return f"<Ticket {self.request_id} {self.status}>"

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def arrival(self) -> float:
        return self._request.arrival

    @property
    def status(self) -> str:
        """queued, running (in a batch call now), completed or failed."""
        if self._request.future.done():
            return "completed" if isinstance(self.outcome(), Result) else "failed"
        return "running" if self._request.running else "queued"

    def done(self) -> bool:
        return self._request.future.done()

    def outcome(self) -> Result | BatchserveError:
        """The result or the error, once done."""
        future = self._request.future
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or (error is not None and not isinstance(error, BatchserveError)):
            return BackendError(f"the request ended unexpectedly: {error!r}")
        return error if isinstance(error, BatchserveError) else future.result()

    def add_done_callback(self, callback: Callable[[Ticket], object]) -> None:
        self._request.future.add_done_callback(lambda _: callback(self))

    async def wait(self, clock: Clock, until: float) -> bool:
        """Waits for the answer until `clock` reaches `until`, never cancelling the request;
        True if it is answered."""
        return await wait_until(clock, self._request.future, until)

    async def result(self) -> Result:
        """Waits for the answer; cancelling the wait leaves the request running."""
        await asyncio.wait([self._request.future])
        outcome = self.outcome()
        if isinstance(outcome, BatchserveError):
            raise outcome
        return outcome

    def __await__(self) -> Generator[Any, None, Result]:
        return self.result().__await__()
