"""The Batch API survives its replica: `kill -9` mid-batch and a restart on the same SQLite
file, or the death of the replica that holds a batch while another shares its Redis. Either
way every line is answered exactly once in the output."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from batchserve.doors.batch_runner import file_object
from batchserve.doors.batch_store import BatchStore, SqliteBatches
from batchserve.doors.batch_store_redis import RedisBatches
from batchserve.errors import StoreUnavailable
from batchserve.models.backends import simulate
from deploy.replicas import free_ports, redis_server

from .conftest import HANG_GUARD_S, real_server
from .test_batch_api import jsonl, line
from .test_result_store import redis_client

LINES = 200
SLOW = ("--devices", "sim:1", "--sim-latency-ms", "5", "--batch-lines-in-flight", "4",
        "--batch-lease-s", "1")  # fmt: skip
"""One device at 5 ms a call, four lines at a time: a batch of LINES takes a while, and a
lease lost with its holder is taken over within a second."""


async def start_batch(session: aiohttp.ClientSession, url: str) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", jsonl(*(line(n) for n in range(LINES))), filename="in.jsonl")
    async with session.post(f"{url}/v1/files", data=form) as answer:
        file = await answer.json()
    body = {"input_file_id": file["id"], "endpoint": "/api/inference", "completion_window": "24h"}
    async with session.post(f"{url}/v1/batches", json=body) as answer:
        return str((await answer.json())["id"])


async def batch_of(session: aiohttp.ClientSession, url: str, batch_id: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/batches/{batch_id}") as answer:
        return await answer.json()  # type: ignore[no-any-return]


async def part_done(session: aiohttp.ClientSession, url: str, batch_id: str) -> None:
    """Returns once some lines, not all, are done: the moment to kill its holder."""
    async with asyncio.timeout(HANG_GUARD_S):
        while (batch := await batch_of(session, url, batch_id))["request_counts"]["completed"] < 8:
            pass
    assert batch["status"] == "in_progress"  # the same poll: a later one may find it done


async def each_line_once(session: aiohttp.ClientSession, url: str, batch_id: str) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        while (batch := await batch_of(session, url, batch_id))["status"] != "completed":
            pass  # each poll is a round trip to the server
    assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    async with session.get(f"{url}/v1/files/{batch['output_file_id']}/content") as answer:
        outputs = [orjson.loads(raw) for raw in (await answer.read()).splitlines()]
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"r{n}" for n in range(LINES))
    for output in outputs:
        n = int(output["custom_id"][1:])
        assert output["response"]["body"]["output"] == simulate(f"in-{n}")


async def test_a_batch_killed_mid_run_resumes_on_restart_each_line_once(tmp_path: Path) -> None:
    flags = ("--batch-db", str(tmp_path / "batches.db"), *SLOW)
    async with real_server(*flags) as server, aiohttp.ClientSession() as session:
        batch_id = await start_batch(session, server.url)
        await part_done(session, server.url, batch_id)
        server.process.send_signal(signal.SIGKILL)
        await server.process.wait()
    async with real_server(*flags) as server, aiohttp.ClientSession() as session:
        await each_line_once(session, server.url, batch_id)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
async def test_a_replica_takes_over_the_batch_of_one_that_died(tmp_path: Path) -> None:
    (redis_port,) = free_ports(1)
    store = ("--result-store", f"redis://127.0.0.1:{redis_port}/0", *SLOW)
    with redis_server(redis_port, tmp_path):
        async with (
            real_server(*store) as first,
            real_server(*store) as second,
            aiohttp.ClientSession() as session,
            redis_client(redis_port) as redis,
        ):
            batch_id = await start_batch(session, first.url)
            await part_done(session, first.url, batch_id)
            holder = (await redis.get(f"batchserve:batches:lease:{batch_id}")).decode()
            pid = int(holder.split(":")[1])
            dying, living = (first, second) if pid == first.process.pid else (second, first)
            assert pid == dying.process.pid
            os.kill(pid, signal.SIGKILL)
            await dying.process.wait()
            await each_line_once(session, living.url, batch_id)


@asynccontextmanager
async def batch_store(
    kind: str, tmp_path: Path
) -> AsyncIterator[tuple[BatchStore, Callable[[], Awaitable[None]]]]:
    """A store of `kind` and a way to let every lease in it lapse (as when the replica
    holding it stalls: a pause, a swap storm) without waiting for it."""
    if kind == "sqlite":
        wall = [1_000.0]

        async def lapse_sqlite() -> None:
            wall[0] += 3_600

        sqlite = SqliteBatches(str(tmp_path / "batches.db"), wall=lambda: wall[0])
        try:
            yield sqlite, lapse_sqlite
        finally:
            await sqlite.close()
        return
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    (redis_port,) = free_ports(1)
    with redis_server(redis_port, tmp_path):
        async with redis_client(redis_port) as redis:
            store = RedisBatches(f"redis://127.0.0.1:{redis_port}/0")
            await store.start()

            async def lapse_redis() -> None:
                await redis.delete(*await redis.keys("batchserve:batches:lease:*"))

            try:
                yield store, lapse_redis
            finally:
                await store.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_replica_that_stalled_past_its_lease_cannot_end_the_batch(
    kind: str, tmp_path: Path
) -> None:
    """Both replicas reach the end of a batch: the one that stalled and lost its lease, and
    the one that took it over. Only the holder writes: else the tenant would find two output
    files, and the batch's output_file_id would change under it."""
    async with batch_store(kind, tmp_path) as (store, lapse):
        batch = {"id": "batch_1", "object": "batch", "status": "in_progress"}
        await store.add_batch("tenant", None, batch, [b"{}"])
        assert [held.batch_id for held in await store.claim("stalled", 60)] == ["batch_1"]
        await lapse()
        assert [held.batch_id for held in await store.claim("taker", 60)] == ["batch_1"]

        def completed(batch: dict[str, Any]) -> dict[str, Any]:
            return batch | {"status": "completed"}

        def output(file_id: str) -> list[tuple[dict[str, Any], bytes]]:
            return [(file_object(file_id, "out.jsonl", "batch_output", 3), b"{}\n")]

        assert (
            await store.finish(
                "tenant", "batch_1", output("file-stalled"), completed, holder="stalled"
            )
            is None
        )
        assert await store.files("tenant", None, 10) == []
        assert (await store.batch("tenant", "batch_1") or {})["status"] == "in_progress"
        ended = await store.finish(
            "tenant", "batch_1", output("file-taker"), completed, holder="taker"
        )
        assert ended is not None
        assert ended["status"] == "completed"
        assert [file["id"] for file in await store.files("tenant", None, 10)] == ["file-taker"]
        assert await store.claim("stalled", 60) == []
        assert (
            await store.finish(
                "tenant", "batch_1", output("file-late"), completed, holder="stalled"
            )
            is None
        )
        assert len(await store.files("tenant", None, 10)) == 1


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
async def test_a_redis_batch_store_that_goes_down_is_unavailable_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The batch store shares the records' Redis client: a failure is StoreUnavailable (a
    503), and going down and coming back are each logged once, not once a request."""
    (redis_port,) = free_ports(1)
    store = RedisBatches(f"redis://127.0.0.1:{redis_port}/0")
    try:
        with redis_server(redis_port, tmp_path):
            await store.start()
            assert await store.file("", "file-x") is None
        with caplog.at_level(logging.WARNING, logger="batchserve"):
            for _ in range(2):
                with pytest.raises(StoreUnavailable, match="the batch store is unavailable"):
                    await store.file("", "file-x")
            down = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            assert len(down) == 1
            assert "(batches) is unavailable" in down[0]
            with redis_server(redis_port, tmp_path):
                assert await store.file("", "file-x") is None
            assert caplog.records[-1].getMessage().endswith("(batches) answers again")
    finally:
        await store.close()
