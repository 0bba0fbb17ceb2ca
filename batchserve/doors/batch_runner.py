"""Runs the Batch API's batches: holds each under a lease, hands its lines to the engine a
few at a time, records each line's outcome as it ends, and writes the output and error
files when the last one is done.

One task (`_hold`) renews this replica's leases every third of `--batch-lease-s` and takes
those of active batches whose holder stopped renewing (it died); each batch held has a task
of its own (`_run`), cancelled if its lease is lost. A batch's task keeps at most
`--batch-lines-in-flight` of its lines in the engine, in the idle tier, so its lines never
fill the online queue; the others wait in the store. A line is recorded in one write with
its done mark (`batch_store.py`), so a replica killed mid-batch loses nothing: the next
holder runs the lines not yet done, and a line that ran but was not recorded runs again,
appearing once in the output. A line whose own deadline passed while online work held the
devices is tried again, up to LATE_TRIES times in all, then recorded with the 504 it got:
a `timeout_ms` that idle time never meets must not hold its batch until the batch expires.
Cancelling, expiry (24 hours after creation) and finishing
each end the batch with its files; what ran is kept.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from ..batching.request import new_request_id
from ..clock import Clock, sleep_until
from ..errors import StoreUnavailable
from ..rules.tenants import TIERS, Tenant
from ..tasks import TaskSet
from .batch_lines import Late, LineRunner, expired_line
from .batch_store import ACTIVE, BatchStore, Held, Line, Outcome, now_s

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""How long a line the server could not take waits before it is offered again."""
EXPIRED = "This request could not be executed before the completion window expired."
LATE_TRIES = 3
"""How often a line whose deadline passed as it waited is tried before its 504 is recorded."""
CHECK_S = 1.0
"""How often a running batch reads its status (a cancel may come through any replica)."""


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        lines: LineRunner,
        *,
        clock: Clock,
        lease_s: float,
        in_flight: int,
        holder: str | None = None,
    ) -> None:
        self._store = store
        self._lines = lines
        self._clock = clock
        self._lease_s = lease_s
        self._in_flight = in_flight
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{new_request_id()[:8]}"
        """This replica's name on the leases it holds."""
        self._running: dict[str, asyncio.Task[None]] = {}
        self._wakes: dict[str, asyncio.Event] = {}
        """Each batch running here: what wakes its task."""
        self._to_read: set[str] = set()
        """Batches whose status changed here: their task reads it at once."""
        self._tasks = TaskSet(self._crashed)
        self._poked = asyncio.Event()

    def __repr__(self) -> str:
        return f"<BatchRunner {self.holder} running={len(self._running)}>"

    async def lifespan(self, app: object) -> AsyncIterator[None]:
        """aiohttp cleanup_ctx, after the engine's: opens the store and resumes what it
        holds; at the end stops every batch (what ran is recorded) and closes it."""
        await self._store.start()
        self._tasks.start(self._hold(), name="batchserve-batch-leases")
        try:
            yield
        finally:
            await self._tasks.aclose()
            for task in self._running.values():
                task.cancel()
            await asyncio.gather(*self._running.values(), return_exceptions=True)
            await self._store.close()

    def poke(self) -> None:
        """A batch was created here: take it now rather than at the next renewal."""
        self._poked.set()

    def status_changed(self, batch_id: str) -> None:
        """A batch was cancelled through this replica: if it runs here, it reads its status
        now and takes no more lines, rather than at its next check (others see it then)."""
        wake = self._wakes.get(batch_id)
        if wake is not None:
            self._to_read.add(batch_id)
            wake.set()

    async def _hold(self) -> None:
        while True:
            self._poked.clear()
            try:
                held = await self._store.claim(self.holder, self._lease_s)
            except StoreUnavailable as error:
                log.error("could not renew the batches' leases: %s", error)
                held = None
            if held is not None:
                self._follow(held)
            renew = sleep_until(self._clock, self._clock.time() + self._lease_s / 3)
            poked = asyncio.ensure_future(self._poked.wait())
            sleeping = asyncio.ensure_future(renew)
            await asyncio.wait((poked, sleeping), return_when=asyncio.FIRST_COMPLETED)
            for waiter in (poked, sleeping):
                waiter.cancel()

    def _follow(self, held: list[Held]) -> None:
        """Starts a task for each batch newly held; cancels those whose lease was lost."""
        ids = {batch.batch_id for batch in held}
        for batch_id in [b for b in self._running if b not in ids]:
            log.warning("lost the lease on %s: another replica runs it now", batch_id)
            self._running.pop(batch_id).cancel()
        for batch in held:
            if batch.batch_id not in self._running:
                task = asyncio.create_task(self._run(batch), name=f"batchserve-{batch.batch_id}")
                self._running[batch.batch_id] = task
                task.add_done_callback(functools.partial(self._ended, batch.batch_id))

    def _ended(self, batch_id: str, task: asyncio.Task[None]) -> None:
        if self._running.get(batch_id) is task:
            del self._running[batch_id]
            if not task.cancelled() and task.exception() is not None:
                log.error("batch %s stopped: %r; it resumes at the next lease renewal",
                          batch_id, task.exception())  # fmt: skip

    async def _run(self, held: Held) -> None:
        batch_id = held.batch_id
        wake = self._wakes[batch_id] = asyncio.Event()  # before any wait: a cancel finds it
        try:
            await self._run_lines(held, wake)
        finally:
            del self._wakes[batch_id]
            self._to_read.discard(batch_id)

    async def _run_lines(self, held: Held, wake: asyncio.Event) -> None:
        store, batch_id = self._store, held.batch_id
        batch = await store.update(batch_id, _started)
        if batch is None:
            return
        tier = held.tier if held.tier in TIERS else "enterprise"
        tenant = Tenant(held.owner, tier, idle=True)
        running: set[asyncio.Task[None]] = set()
        retry: deque[Line] = deque()
        """Lines read from the store, to hand to the engine: fresh ones, and those the
        server could not take (back after RETRY_S)."""
        late: dict[int, int] = {}
        """Tries that ended past their deadline, by line: of lines running or in `retry`."""
        cursor = -1
        checked = self._clock.time()
        try:
            while batch["status"] == "in_progress" and now_s() < batch["expires_at"]:
                wake.clear()  # before the store is read: a line ending meanwhile wakes it
                while len(running) < self._in_flight and batch_id not in self._to_read:
                    if not retry:
                        fresh = await store.pending(batch_id, cursor, self._in_flight)
                        if not fresh:
                            break
                        cursor = fresh[-1].position
                        retry.extend(fresh)
                        continue  # a cancel may have come meanwhile
                    line = retry.popleft()
                    task = asyncio.create_task(self._line(batch, line, tenant, (retry, late), wake))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if not running and not retry:
                    break
                if batch_id not in self._to_read:  # else its status is to be read now
                    alarm = self._clock.call_at(self._clock.time() + CHECK_S, wake.set)
                    await wake.wait()
                    alarm.cancel()
                if batch_id in self._to_read or self._clock.time() >= checked + CHECK_S:
                    self._to_read.discard(batch_id)
                    checked = self._clock.time()
                    batch = await store.update(batch_id, _unchanged) or batch
            if running:  # cancelled, or expired: what runs still counts
                await asyncio.gather(*running, return_exceptions=True)
        except asyncio.CancelledError:  # the lease was lost, or the server stops
            for task in running:
                task.cancel()
            raise
        await self._finish(held.owner, batch_id)

    async def _line(
        self,
        batch: dict[str, Any],
        line: Line,
        tenant: Tenant,
        again: tuple[deque[Line], dict[int, int]],
        wake: asyncio.Event,
    ) -> None:
        retry, late = again
        try:
            outcome = await self._lines.run(line.request, batch["endpoint"], tenant)
            if isinstance(outcome, Late):
                tries = late[line.position] = late.get(line.position, 0) + 1
                outcome = outcome.outcome if tries >= LATE_TRIES else None
            if outcome is None:
                await sleep_until(self._clock, self._clock.time() + RETRY_S)
                retry.append(line)
            else:
                late.pop(line.position, None)
                await self._record(batch["id"], line.position, outcome)
        finally:
            wake.set()

    async def _record(self, batch_id: str, index: int, outcome: Outcome) -> None:
        """Records until the store takes it: a line is run once where it can be helped."""
        while True:
            try:
                await self._store.record(batch_id, index, outcome)
                return
            except StoreUnavailable as error:
                log.error("could not record line %d of %s: %s", index, batch_id, error)
                await sleep_until(self._clock, self._clock.time() + RETRY_S)

    async def _finish(self, owner: str, batch_id: str) -> None:
        """Ends the batch as its status says: completed, cancelled or expired, with its
        output and error files (those with lines)."""
        store = self._store
        batch = await store.update(batch_id, _finalizing)
        if batch is None or batch["status"] not in ACTIVE:
            return
        ending = _ending(batch)
        if ending == "expired":
            for line in await store.pending(batch_id, -1, 1 << 62):
                unrun = expired_line(line.request, "batch_expired", EXPIRED)
                await self._record(batch_id, line.position, Outcome(True, unrun))
        outcomes = await store.outcomes(batch_id)
        outputs = [o.line for o in outcomes if not o.failed]
        errors = [o.line for o in outcomes if o.failed]
        files = {
            kind: _result_file(batch_id, kind, lines)
            for kind, lines in (("output", outputs), ("error", errors))
            if lines
        }

        def ended(batch: dict[str, Any]) -> dict[str, Any]:
            stamp = {"completed": "completed_at", "cancelled": "cancelled_at",
                     "expired": "expired_at"}[ending]  # fmt: skip
            return batch | {
                "status": ending,
                stamp: now_s(),
                "output_file_id": files["output"][0]["id"] if "output" in files else None,
                "error_file_id": files["error"][0]["id"] if "error" in files else None,
            }

        if await store.finish(owner, batch_id, list(files.values()), ended,
                              holder=self.holder) is None:  # fmt: skip
            log.warning("lost the lease on %s before ending it: its next holder ends it", batch_id)
            return
        log.info("batch %s %s: %d lines answered, %d failed", batch_id, ending,
                 len(outputs), len(errors))  # fmt: skip

    def _crashed(self, task_name: str, error: BaseException) -> None:
        log.critical("%s crashed: %r; batches are not run until a restart", task_name, error)


def _started(batch: dict[str, Any]) -> dict[str, Any] | None:
    if batch["status"] != "validating":
        return None
    return batch | {"status": "in_progress", "in_progress_at": now_s()}


def _unchanged(batch: dict[str, Any]) -> None:
    return None


def _ending(batch: dict[str, Any]) -> str:
    if batch.get("cancelling_at") is not None:
        return "cancelled"
    if now_s() >= batch["expires_at"]:
        return "expired"
    return "completed"


def _finalizing(batch: dict[str, Any]) -> dict[str, Any] | None:
    if batch["status"] in ("in_progress", "validating"):
        return batch | {"status": "finalizing", "finalizing_at": now_s()}
    return None


def _result_file(batch_id: str, kind: str, lines: list[bytes]) -> tuple[dict[str, Any], bytes]:
    content = b"".join(line + b"\n" for line in lines)
    file = file_object(
        f"file-{new_request_id()[:24]}", f"{batch_id}_{kind}.jsonl", "batch_output", len(content)
    )
    return file, content


def file_object(file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
    """OpenAI's file object."""
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": now_s(),
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }
