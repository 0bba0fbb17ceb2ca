"""Where the Batch API's files, batches and lines live: SQLite on disk (`--batch-db`), or the
Redis of `--result-store redis://...` so that replicas share them (`batch_store_redis.py`).

Each stored object is OpenAI's JSON (a file's, a batch's) beside its owner: a tenant's
id scope, "" on a server without keys; every read names the owner, so a tenant never sees
another's. A batch's lines are rows of their own: each is marked done in the same write that
records its output (or its error), and only if it was not done yet, so a line run twice (its
holder killed after the run, before the write) is recorded once. One replica holds a batch at
a time: it holds a lease that it renews, and a lease not renewed for `--batch-lease-s` (its
holder died) is taken over by the next replica to ask.

The SQLite file holds tenants' inputs and answers, so it is its owner's alone (0600).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol, TypeVar

import orjson

from ..errors import StartupError
from .shared_records import _private
from .store_health import StoreHealth

Result = TypeVar("Result")
Change = Callable[[dict[str, Any]], dict[str, Any] | None]
"""A batch object's update: the new object, or None to leave it as it is."""

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
"""The statuses of a batch some replica must hold and move on."""


class Line(NamedTuple):
    position: int
    """Its place in the input file's requests, from 0."""
    request: bytes
    """The input file's line, as uploaded."""


class Held(NamedTuple):
    batch_id: str
    owner: str
    tier: str | None
    """The owner's tier when it created the batch (None: no keys); its lines run as it."""


class Outcome(NamedTuple):
    failed: bool
    line: bytes
    """The output (or error) file's line for it."""


class BatchStore(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def add_file(self, owner: str, file: dict[str, Any], content: bytes) -> None: ...

    async def file(self, owner: str, file_id: str) -> dict[str, Any] | None: ...

    async def content(self, owner: str, file_id: str) -> bytes | None: ...

    async def files(self, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        """The owner's files, newest first, those older than `after` (an id) only."""

    async def delete_file(self, owner: str, file_id: str) -> bool: ...

    async def add_batch(
        self, owner: str, tier: str | None, batch: dict[str, Any], lines: list[bytes]
    ) -> None: ...

    async def batch(self, owner: str, batch_id: str) -> dict[str, Any] | None:
        """The batch object, its request_counts as they stand."""

    async def batches(self, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]: ...

    async def update(self, batch_id: str, change: Change) -> dict[str, Any] | None:
        """Applies `change` to the stored object atomically; the object after it."""

    async def claim(self, holder: str, lease_s: float) -> list[Held]:
        """Renews `holder`'s leases and takes those of active batches no live replica
        holds; the batches `holder` holds now."""

    async def release(self, batch_id: str, holder: str) -> None: ...

    async def pending(self, batch_id: str, after: int, limit: int) -> list[Line]:
        """Lines not done, with an index above `after`, in order."""

    async def record(self, batch_id: str, index: int, outcome: Outcome) -> bool:
        """Marks the line done with its outcome, in one write; False if it was done."""

    async def outcomes(self, batch_id: str) -> list[Outcome]:
        """The done lines' outcomes in the input's order."""

    async def finish(
        self,
        owner: str,
        batch_id: str,
        files: list[tuple[dict[str, Any], bytes]],
        change: Change,
        *,
        holder: str,
    ) -> dict[str, Any] | None:
        """Adds the output and error files and applies `change`, all at once, if `holder`
        still holds the batch's lease; else writes nothing and returns None. A replica that
        stalled past its lease must not end a batch that another has taken over."""


def now_s() -> int:
    """OpenAI's timestamps: whole seconds of wall time (records outlive the process)."""
    return int(time.time())


class SqliteBatches:
    """One file; every statement runs on the store's own thread (sqlite3 blocks), each
    call one transaction. Opened at start only if the file exists, else at the first write,
    so a server that never uses the Batch API leaves no file behind."""

    def __init__(self, path: str, *, wall: Callable[[], float] = time.time) -> None:
        self._path = path
        self._wall = wall
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="batchserve-batches")
        self._db: sqlite3.Connection | None = None
        self._health = StoreHealth("batch store", f"--batch-db {path}")

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            _private(self._path)
            db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA secure_delete=ON")
            db.execute("PRAGMA busy_timeout=5000")  # replicas on one file wait their turn
            for statement in _SCHEMA:
                db.execute(statement)
            self._db = db
        return self._db

    async def _run(
        self, work: Callable[[sqlite3.Connection], Result], *, create: bool = True
    ) -> Result:
        """`work` in one transaction on the store's thread; `create`: open (or create) the
        file first if it is not open, else raise _Empty."""

        def call() -> Result:
            if self._db is None and not create:
                raise _Empty
            db = self._connect()
            db.execute("BEGIN IMMEDIATE")
            try:
                result = work(db)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return result

        done = asyncio.get_running_loop().run_in_executor(self._thread, call)
        return await self._health.run(done, (sqlite3.Error,))

    async def start(self) -> None:
        def open_existing() -> None:
            if os.path.exists(self._path):
                self._connect()

        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, open_existing)
        except (OSError, sqlite3.Error) as exc:
            raise StartupError(f"--batch-db {self._path}: {exc}") from None

    async def close(self) -> None:
        if self._db is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._db.close)
        self._thread.shutdown()

    async def _read(self, work: Callable[[sqlite3.Connection], Result], empty: Result) -> Result:
        """A read: `empty` while no file exists (nothing was ever stored)."""
        try:
            return await self._run(work, create=False)
        except _Empty:
            return empty

    async def add_file(self, owner: str, file: dict[str, Any], content: bytes) -> None:
        await self._run(lambda db: _put_file(db, owner, file, content))

    async def file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        row = await self._read(lambda db: db.execute(
            "SELECT object FROM files WHERE id = ? AND owner = ?", (file_id, owner)
        ).fetchone(), None)  # fmt: skip
        return None if row is None else _object(row[0])

    async def content(self, owner: str, file_id: str) -> bytes | None:
        row = await self._read(lambda db: db.execute(
            "SELECT content FROM files WHERE id = ? AND owner = ?", (file_id, owner)
        ).fetchone(), None)  # fmt: skip
        return None if row is None else bytes(row[0])

    async def files(self, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        return await self._read(lambda db: _page(db, "files", owner, after, limit), [])

    async def delete_file(self, owner: str, file_id: str) -> bool:
        deleted = await self._read(lambda db: db.execute(
            "DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)
        ).rowcount, 0)  # fmt: skip
        return bool(deleted)

    async def add_batch(
        self, owner: str, tier: str | None, batch: dict[str, Any], lines: list[bytes]
    ) -> None:
        def insert(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO batches (id, owner, tier, object, active) VALUES (?, ?, ?, ?, ?)",
                (batch["id"], owner, tier, orjson.dumps(batch), batch["status"] in ACTIVE),
            )
            db.executemany(
                "INSERT INTO lines (batch_id, idx, request) VALUES (?, ?, ?)",
                ((batch["id"], index, line) for index, line in enumerate(lines)),
            )

        await self._run(insert)

    async def batch(self, owner: str, batch_id: str) -> dict[str, Any] | None:
        def select(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute(
                "SELECT object FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)
            ).fetchone()
            return None if row is None else _counted(db, _object(row[0]))

        return await self._read(select, None)

    async def batches(self, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        def select(db: sqlite3.Connection) -> list[dict[str, Any]]:
            return [_counted(db, batch) for batch in _page(db, "batches", owner, after, limit)]

        return await self._read(select, [])

    async def update(self, batch_id: str, change: Change) -> dict[str, Any] | None:
        return await self._run(lambda db: _update(db, batch_id, change))

    async def claim(self, holder: str, lease_s: float) -> list[Held]:
        def take(db: sqlite3.Connection) -> list[Held]:
            now = self._wall()
            db.execute(
                "UPDATE batches SET holder = ?, lease_until = ? WHERE active = 1 AND"
                " (holder IS NULL OR holder = ? OR lease_until < ?)",
                (holder, now + lease_s, holder, now),
            )
            rows = db.execute(
                "SELECT id, owner, tier FROM batches WHERE active = 1 AND holder = ?", (holder,)
            ).fetchall()
            return [Held(*row) for row in rows]

        return await self._read(take, [])

    async def release(self, batch_id: str, holder: str) -> None:
        await self._run(lambda db: db.execute(
            "UPDATE batches SET holder = NULL WHERE id = ? AND holder = ?", (batch_id, holder)
        ))  # fmt: skip

    async def pending(self, batch_id: str, after: int, limit: int) -> list[Line]:
        rows: list[tuple[int, bytes]] = await self._read(lambda db: db.execute(
            "SELECT idx, request FROM lines WHERE batch_id = ? AND done = 0 AND idx > ?"
            " ORDER BY idx LIMIT ?", (batch_id, after, limit),
        ).fetchall(), [])  # fmt: skip
        return [Line(index, bytes(request)) for index, request in rows]

    async def record(self, batch_id: str, index: int, outcome: Outcome) -> bool:
        recorded = await self._run(lambda db: db.execute(
            "UPDATE lines SET done = 1, failed = ?, result = ?"
            " WHERE batch_id = ? AND idx = ? AND done = 0",
            (outcome.failed, outcome.line, batch_id, index),
        ).rowcount)  # fmt: skip
        return bool(recorded)

    async def outcomes(self, batch_id: str) -> list[Outcome]:
        rows: list[tuple[int, bytes]] = await self._read(lambda db: db.execute(
            "SELECT failed, result FROM lines WHERE batch_id = ? AND done = 1 ORDER BY idx",
            (batch_id,),
        ).fetchall(), [])  # fmt: skip
        return [Outcome(bool(failed), bytes(line)) for failed, line in rows]

    async def finish(
        self,
        owner: str,
        batch_id: str,
        files: list[tuple[dict[str, Any], bytes]],
        change: Change,
        *,
        holder: str,
    ) -> dict[str, Any] | None:
        def write(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute("SELECT holder FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row[0] != holder:
                return None
            for file, content in files:
                _put_file(db, owner, file, content)
            return _update(db, batch_id, change)

        return await self._run(write)


class _Empty(Exception):
    """A read before any file exists."""


_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE"
    " NOT NULL, owner TEXT NOT NULL, object BLOB NOT NULL, content BLOB NOT NULL)",
    "CREATE TABLE IF NOT EXISTS batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE"
    " NOT NULL, owner TEXT NOT NULL, tier TEXT, object BLOB NOT NULL, active INTEGER NOT NULL,"
    " holder TEXT, lease_until REAL)",
    "CREATE TABLE IF NOT EXISTS lines (batch_id TEXT NOT NULL, idx INTEGER NOT NULL,"
    " request BLOB NOT NULL, done INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL"
    " DEFAULT 0, result BLOB, PRIMARY KEY (batch_id, idx))",
    "CREATE INDEX IF NOT EXISTS files_owner ON files (owner, seq)",
    "CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, seq)",
    "CREATE INDEX IF NOT EXISTS batches_active ON batches (active)",
)


def _put_file(db: sqlite3.Connection, owner: str, file: dict[str, Any], content: bytes) -> None:
    db.execute(
        "INSERT INTO files (id, owner, object, content) VALUES (?, ?, ?, ?)",
        (file["id"], owner, orjson.dumps(file), content),
    )


def _object(data: bytes | str) -> dict[str, Any]:
    value: dict[str, Any] = orjson.loads(data)
    return value


def _page(
    db: sqlite3.Connection, table: str, owner: str, after: str | None, limit: int
) -> list[dict[str, Any]]:
    """Newest first; with `after`, those stored before that id (none if it is unknown)."""
    query = f"SELECT object FROM {table} WHERE owner = ?"  # a table of ours, not input
    params: tuple[Any, ...] = (owner,)
    if after is not None:
        query += f" AND seq < (SELECT seq FROM {table} WHERE id = ? AND owner = ?)"
        params += (after, owner)
    rows = db.execute(query + " ORDER BY seq DESC LIMIT ?", (*params, limit)).fetchall()
    return [_object(row[0]) for row in rows]


def _counted(db: sqlite3.Connection, batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with its request_counts as its lines stand."""
    total, done, failed = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(done), 0), COALESCE(SUM(failed), 0) FROM lines"
        " WHERE batch_id = ?",
        (batch["id"],),
    ).fetchone()
    if total:
        batch["request_counts"] = {"total": total, "completed": done - failed, "failed": failed}
    return batch


def _update(db: sqlite3.Connection, batch_id: str, change: Change) -> dict[str, Any] | None:
    row = db.execute("SELECT object FROM batches WHERE id = ?", (batch_id,)).fetchone()
    if row is None:
        return None
    batch = _object(row[0])
    changed = change(batch)
    if changed is None:
        return _counted(db, batch)
    active = changed["status"] in ACTIVE
    db.execute(
        "UPDATE batches SET object = ?, active = ?,"
        " holder = CASE WHEN ? THEN holder ELSE NULL END WHERE id = ?",
        (orjson.dumps(changed), active, active, batch_id),
    )
    return _counted(db, changed)
