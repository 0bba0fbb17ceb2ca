"""--result-store: SQLite that survives kill -9 (queued requests run again, each tenant sees
only its own), and a real Redis shared by three replicas behind real nginx (every poll finds
its request, whichever replica it reaches). Each is skipped where its server is missing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sqlite3
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio

from batchserve.clock import FakeClock
from batchserve.doors.batch_store_redis import RedisBatches
from batchserve.doors.shared_records import Record, SqliteRecords, open_records
from batchserve.errors import StartupError, StoreUnavailable
from deploy.replicas import Replicas, free_ports, redis_server

from .conftest import TWO_TENANT_KEYS, real_server, until


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def poll_until_done(
    session: aiohttp.ClientSession, url: str, request_id: str, key: str | None = None
) -> dict[str, object]:
    """Long polls: each is held by the replica it reaches until the request ends (awaited
    there, or read again from the shared store) or 10 s pass."""
    headers = bearer(key) if key else {}
    for _ in range(30):
        async with session.get(
            f"{url}/api/requests/{request_id}?wait_ms=10000", headers=headers
        ) as answer:
            assert answer.status == 200, await answer.text()
            body = await answer.json()
        if body["status"] in {"completed", "failed"}:
            return dict(body)
    raise AssertionError(f"{request_id} never finished")


async def test_sqlite_requests_queued_at_kill_9_run_after_restart(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(TWO_TENANT_KEYS)
    store = f"sqlite:///{tmp_path / 'records.db'}"
    common = ("--devices", "sim:1", "--max-batch-size", "1", "--result-store", store,
              "--keys-file", str(keys))  # fmt: skip
    texts = [f"queued-{n}" for n in range(4)]
    async with (
        real_server(*common, "--sim-latency-ms", "60000") as server,
        aiohttp.ClientSession() as session,
    ):
        for text in texts:
            async with session.post(
                f"{server.url}/api/requests", json={"input": text},
                headers={**bearer("sk-alice"), "X-Request-Id": text},
            ) as answer:  # fmt: skip
                assert answer.status == 202
        server.process.send_signal(signal.SIGKILL)
        await server.process.wait()
    async with (
        real_server(*common, "--sim-latency-ms", "1") as server,
        aiohttp.ClientSession() as session,
    ):
        for text in texts:
            answer = await poll_until_done(session, server.url, text, "sk-alice")
            assert (answer["status"], answer["output"]) == ("completed", text[::-1])
            async with session.get(
                f"{server.url}/api/requests/{text}", headers=bearer("sk-bob")
            ) as other:
                assert other.status == 404  # another tenant's request looks unknown
            async with session.post(
                f"{server.url}/api/requests", json={"input": "again"},
                headers={**bearer("sk-alice"), "X-Request-Id": text},
            ) as again:  # fmt: skip
                assert again.status == 409  # its id stays taken until the record expires
        refused = {"input": "x", "model": "no-such-model"}
        for status in (404, 404):  # a refused submit leaves its id free for the next try
            async with session.post(
                f"{server.url}/api/requests", json=refused,
                headers={**bearer("sk-alice"), "X-Request-Id": "refused"},
            ) as answer:  # fmt: skip
                assert answer.status == status


@contextlib.asynccontextmanager
async def redis_client(port: int) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis(port=port)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.mark.skipif(
    shutil.which("nginx") is None or shutil.which("redis-server") is None,
    reason="nginx or redis-server is not installed",
)
async def test_replicas_sharing_redis_find_every_poll_through_nginx(tmp_path: Path) -> None:
    nginx_port, redis_port, *replica_ports = free_ports(5)
    with redis_server(redis_port, tmp_path):
        async with redis_client(redis_port) as client:
            replicas = Replicas(
                nginx_port, replica_ports,
                ["--devices", "sim:1", "--sim-latency-ms", "5", "--result-ttl-s", "120",
                 "--result-store", f"redis://127.0.0.1:{redis_port}/0"],
            )  # fmt: skip
            await asyncio.to_thread(replicas.start)
            try:
                url = f"http://127.0.0.1:{nginx_port}"
                texts = [f"shared-{n}" for n in range(60)]
                async with aiohttp.ClientSession() as session:
                    for text in texts:
                        async with session.post(
                            f"{url}/api/requests", json={"input": text},
                            headers={"X-Request-Id": text},
                        ) as answer:  # fmt: skip
                            assert answer.status == 202
                    for text in texts:  # each poll may reach any replica
                        answer = await poll_until_done(session, url, text)
                        assert (answer["status"], answer["output"]) == ("completed", text[::-1])
                ttl_ms = await client.pttl(f"batchserve:request:{texts[0]}")
                assert 0 < ttl_ms <= 120_000
            finally:
                await asyncio.to_thread(replicas.close)


def rows(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return int(db.execute("SELECT COUNT(*) FROM records").fetchone()[0])


async def test_sqlite_files_are_private_and_expired_records_leave_on_a_timer(
    tmp_path: Path,
) -> None:
    """The files are 0600 (another local user must not read a tenant's inputs), and an
    expired record is deleted by the store's own purge, with no submit to trigger it."""
    path = tmp_path / "records.db"
    clock, wall = FakeClock(), [1000.0]
    store = SqliteRecords(str(path), clock, wall=lambda: wall[0], purge_every_s=60.0)
    old = os.umask(0o022)
    try:
        await store.start()
    finally:
        os.umask(old)
    try:
        await store.add("r1", Record("alice", {"status": "queued", "request_id": "r1"}))
        await store.finish("r1", Record("alice", {"status": "completed", "output": "x"}), 10.0)
        for name in ("records.db", "records.db-wal", "records.db-shm"):
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
        wall[0] += 11.0  # expired, and nobody submits or polls
        assert rows(path) == 1
        clock.advance(60.0)  # the purge's timer fires
        # Polled: the purge runs on the store's thread, which the loop hears of only
        # through the executor's future.
        await until(lambda: store.purged != 0)
        assert rows(path) == 0
    finally:
        await store.close()


async def test_sqlite_a_purged_records_input_leaves_the_wal_file_too(tmp_path: Path) -> None:
    """The WAL keeps the frames that wrote a record until a checkpoint; a purge truncates it,
    so a purged input is not readable in the -wal file until a clean shutdown."""
    path = tmp_path / "records.db"
    wall = [1000.0]
    store = SqliteRecords(str(path), FakeClock(), wall=lambda: wall[0])
    secret = "a tenant's secret input 7f3a"
    await store.start()
    try:
        queued = {"status": "queued", "request_id": "r1", "submitted": {"text": secret}}
        await store.add("r1", Record("alice", queued))
        await store.finish("r1", Record("alice", {"status": "completed", "output": secret}), 10.0)
        await store.add("r2", Record("alice", {"status": "queued", "request_id": "r2"}))
        wal = tmp_path / "records.db-wal"
        assert secret.encode() in wal.read_bytes()  # written there first
        wall[0] += 11.0
        assert await store.purge() == 1
        assert secret.encode() not in wal.read_bytes()
        assert secret.encode() not in path.read_bytes()
        assert await store.get("r2") is not None  # the live record stays
    finally:
        await store.close()


async def test_sqlite_a_poll_deletes_the_expired_record_it_finds(tmp_path: Path) -> None:
    path = tmp_path / "records.db"
    wall = [1000.0]
    store = SqliteRecords(str(path), FakeClock(), wall=lambda: wall[0])
    await store.start()
    try:
        await store.add("r1", Record(None, {"status": "queued", "request_id": "r1"}))
        await store.finish("r1", Record(None, {"status": "completed"}), 10.0)
        wall[0] += 11.0
        assert rows(path) == 1
        assert await store.get("r1") is None
        assert rows(path) == 0
    finally:
        await store.close()


async def test_a_redis_password_never_reaches_an_error_or_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Startup errors and store-down lines reach logs that others read: a password in
    --result-store shows as *** there (nothing listens on port 9: every call fails)."""
    url = "redis://reader:s3cret-pw@127.0.0.1:9/0"
    records = open_records(url, 60.0, FakeClock())
    assert records is not None
    batches = RedisBatches(url)
    for store in (records, batches):
        with pytest.raises(StartupError) as refused:
            await store.start()
        assert "s3cret-pw" not in str(refused.value)
        assert "redis://reader:***@127.0.0.1:9/0" in str(refused.value)
    with pytest.raises(StoreUnavailable):  # logged once, as the store goes down
        await records.get("a-request")
    with pytest.raises(StoreUnavailable):
        await batches.file("a-tenant", "file-1")
    await records.close()
    await batches.close()
    logged = [record.getMessage() for record in caplog.records]
    assert sum("***" in line for line in logged) == 2
    assert all("s3cret-pw" not in line for line in logged)
    with pytest.raises(StartupError) as bad_scheme:
        open_records("rediss://reader:s3cret-pw@127.0.0.1:9/0", 60.0, FakeClock())
    assert "s3cret-pw" not in str(bad_scheme.value)
