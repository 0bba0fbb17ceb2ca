"""Submit-then-poll records that outlive one process: in Redis (shared by replicas behind a
load balancer) or in SQLite (one replica that must survive a restart).

`--result-store redis://host:port/db` or `sqlite:///path/to/file.db`; the default, memory,
needs none of this (`status_store.py` alone). The status API writes a record when it accepts a
request (its input and the tenant that owns it, state queued) and again when it ends (the
answer, kept `ttl_s`); a poll that this replica cannot answer from memory reads it here, so
it may reach any replica. A queued record whose replica stopped before answering it is run
again by the next replica to start on the same SQLite file (inference has no side effects).

A store that fails a read or write (Redis down, a disk error) raises `StoreUnavailable`, which
the door answers 503 with Retry-After; `check` says whether it answers now, for /readyz. The
detail (addresses, the driver's message) goes to the log, not to clients (`store_health.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol, TypeVar
from urllib.parse import urlsplit

import orjson

from ..clock import Clock, sleep_until
from ..errors import StartupError
from .redis_client import RedisClient, shown
from .store_health import StoreHealth

log = logging.getLogger(__name__)

Result = TypeVar("Result")

PURGE_EVERY_S = 60.0
"""How often the SQLite store deletes the records whose time to live has passed, so that a
tenant's inputs and answers leave the disk within a minute of expiring, not at the next
submit."""


class Record(NamedTuple):
    owner: str | None
    """The tenant's name; None on a server without keys. Only the owner may read it."""
    body: dict[str, Any]
    """queued: {"status", "request_id", "submitted": the request's fields}; ended: the answer."""


class SharedRecords(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def add(self, request_id: str, record: Record) -> bool:
        """Stores a new request's record; False (and nothing stored) if the id is taken."""

    async def finish(self, request_id: str, record: Record, ttl_s: float) -> None: ...

    async def remove(self, request_id: str) -> None:
        """Forgets a request the engine refused after its record was added."""

    async def get(self, request_id: str) -> Record | None: ...

    async def unfinished(self) -> list[tuple[str, Record]]:
        """Records accepted and never finished: what a restart runs again."""

    async def check(self) -> None:
        """Returns if the store answers now; else raises StoreUnavailable."""


def open_records(url: str, unfinished_ttl_s: float, clock: Clock) -> SharedRecords | None:
    """The store `--result-store` names; None for memory. `unfinished_ttl_s` bounds how long
    a queued record may outlive a replica that never finished it; `clock` times the SQLite
    store's purges."""
    if url == "memory":
        return None
    parts = urlsplit(url)
    if parts.scheme == "sqlite" and parts.path:
        return SqliteRecords(parts.path, clock)
    if parts.scheme == "redis":
        return RedisRecords(url, unfinished_ttl_s)
    raise StartupError(
        f"--result-store {shown(url)}: expected memory, sqlite:///path/file.db or "
        "redis://host:port/db"
    )


def _dump(record: Record) -> bytes:
    return orjson.dumps({"owner": record.owner, "body": record.body})


def _load(data: bytes | str) -> Record:
    value = orjson.loads(data)
    return Record(value["owner"], value["body"])


class SqliteRecords:
    """One file; every statement runs on the store's own thread (sqlite3 blocks).

    The file holds tenants' inputs and answers, so it is readable by its owner only (0600;
    SQLite gives its -wal and -shm files the database file's mode). Expiry is by wall time
    (`wall`, since records outlive the process); expired records are deleted every
    `purge_every_s` of `clock` by a task that `start` starts and `close` stops, and one a
    poll finds expired is deleted then. A deleted record's bytes leave the disk too:
    secure_delete zeroes them in the database's pages, and each purge checkpoints the WAL
    and truncates it, which would otherwise keep them (in the frames written before the
    delete) until a clean shutdown."""

    def __init__(
        self,
        path: str,
        clock: Clock,
        *,
        wall: Callable[[], float] = time.time,
        purge_every_s: float = PURGE_EVERY_S,
    ) -> None:
        self._path = path
        self._clock = clock
        self._wall = wall
        self._purge_every_s = purge_every_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="batchserve-sqlite")
        self._db: sqlite3.Connection | None = None
        self._health = StoreHealth("result store", f"--result-store sqlite://{path}")
        self._purger: asyncio.Task[None] | None = None
        self.purged = 0
        """Expired records deleted by the purge so far."""

    async def _run(self, work: Callable[[sqlite3.Connection], Result]) -> Result:
        def call() -> Result:
            assert self._db is not None
            with self._db:  # one transaction
                return work(self._db)

        done = asyncio.get_running_loop().run_in_executor(self._thread, call)
        return await self._health.run(done, (sqlite3.Error,))

    async def start(self) -> None:
        def connect() -> None:
            _private(self._path)
            self._db = sqlite3.connect(self._path, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA secure_delete=ON")  # the default of some builds only
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS records (id TEXT PRIMARY KEY, record BLOB NOT NULL,"
                " finished INTEGER NOT NULL, expires REAL)"
            )
            self._db.execute("CREATE INDEX IF NOT EXISTS records_expires ON records (expires)")

        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, connect)
        except (OSError, sqlite3.Error) as exc:
            raise StartupError(f"--result-store sqlite://{self._path}: {exc}") from None
        self._purger = asyncio.create_task(self._purge_every(), name="batchserve-sqlite-purge")

    async def purge(self) -> int:
        """Deletes every record whose time to live has passed, then empties the WAL of what
        was deleted since the last purge (a record's input stays readable there until a
        checkpoint); how many."""
        now = self._wall()
        purged = await self._run(
            lambda db: db.execute("DELETE FROM records WHERE expires < ?", (now,)).rowcount
        )
        busy, _, _ = await self._run(
            lambda db: db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        )
        if busy:  # a reader held it (another process on the file): the next purge tries again
            log.warning("the result store's WAL could not be truncated; the next purge retries")
        return purged

    async def _purge_every(self) -> None:
        while True:
            await sleep_until(self._clock, self._clock.time() + self._purge_every_s)
            try:
                self.purged += await self.purge()
            except sqlite3.Error as exc:  # a full disk: the next purge tries again
                log.error("the result store's purge failed: %s", exc)

    async def close(self) -> None:
        if self._purger is not None:
            self._purger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._purger
        if self._db is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._db.close)
        self._thread.shutdown()

    async def add(self, request_id: str, record: Record) -> bool:
        def insert(db: sqlite3.Connection) -> bool:
            db.execute("DELETE FROM records WHERE expires < ?", (self._wall(),))
            cursor = db.execute(
                "INSERT OR IGNORE INTO records VALUES (?, ?, 0, NULL)", (request_id, _dump(record))
            )
            return cursor.rowcount == 1

        return await self._run(insert)

    async def finish(self, request_id: str, record: Record, ttl_s: float) -> None:
        await self._run(
            lambda db: db.execute(
                "REPLACE INTO records VALUES (?, ?, 1, ?)",
                (request_id, _dump(record), self._wall() + ttl_s),
            )
        )

    async def remove(self, request_id: str) -> None:
        await self._run(lambda db: db.execute("DELETE FROM records WHERE id = ?", (request_id,)))

    async def get(self, request_id: str) -> Record | None:
        def select(db: sqlite3.Connection) -> Record | None:
            now = self._wall()
            row = db.execute(
                "SELECT record, expires FROM records WHERE id = ?", (request_id,)
            ).fetchone()
            if row is None:
                return None
            if row[1] is not None and row[1] < now:  # expired: gone from the disk now
                db.execute("DELETE FROM records WHERE id = ? AND expires < ?", (request_id, now))
                return None
            return _load(row[0])

        return await self._run(select)

    async def unfinished(self) -> list[tuple[str, Record]]:
        rows = await self._run(
            lambda db: db.execute("SELECT id, record FROM records WHERE finished = 0").fetchall()
        )
        return [(request_id, _load(data)) for request_id, data in rows]

    async def check(self) -> None:
        await self._run(lambda db: db.execute("SELECT 1").fetchone())


def _private(path: str) -> None:
    """Creates the database file readable and writable by its owner only, or makes an
    existing one so, with any -wal and -shm files beside it, before SQLite opens it."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for name in (path, f"{path}-wal", f"{path}-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(name, 0o600)


class RedisRecords:
    """One key per request (batchserve:request:<id>), each with its own expiry."""

    PREFIX = "batchserve:request:"

    def __init__(self, url: str, unfinished_ttl_s: float) -> None:
        where = f"--result-store {shown(url)}"
        self._client = RedisClient(url, StoreHealth("result store", where))
        self._redis = self._client.redis
        self._unfinished_ttl_ms = max(1, round(unfinished_ttl_s * 1e3))

    async def start(self) -> None:
        await self._client.start()

    async def close(self) -> None:
        await self._client.close()

    async def add(self, request_id: str, record: Record) -> bool:
        key = self.PREFIX + request_id
        added = self._redis.set(key, _dump(record), nx=True, px=self._unfinished_ttl_ms)
        return bool(await self._client.run(added))

    async def finish(self, request_id: str, record: Record, ttl_s: float) -> None:
        key = self.PREFIX + request_id
        await self._client.run(self._redis.set(key, _dump(record), px=max(1, round(ttl_s * 1e3))))

    async def remove(self, request_id: str) -> None:
        await self._client.run(self._redis.delete(self.PREFIX + request_id))

    async def get(self, request_id: str) -> Record | None:
        data = await self._client.run(self._redis.get(self.PREFIX + request_id))
        return None if data is None else _load(data)

    async def check(self) -> None:
        await self._client.run(self._redis.ping())

    async def unfinished(self) -> list[tuple[str, Record]]:
        """Replicas share Redis, so a record queued elsewhere is that replica's to run: none
        is run again here."""
        return []
