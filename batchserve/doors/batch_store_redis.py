"""The Batch API's store in Redis (`--result-store redis://...`): what replicas behind one
load balancer share, so that any of them answers for a batch and one takes over another's.

Keys, under `batchserve:batches:`: `file:<id>` and `content:<id>` (a file's object with its
owner, and its bytes), `batch:<id>` (a batch's object, owner and tier), per owner the sorted
sets `files:<owner>` and `list:<owner>` (newest last, by a counter), `active` (the batches
some replica must hold), `lines:<id>` (the input's lines, a list), `done:<id>` (each done
line's outcome by its place: HSETNX, so a line is recorded once, with its done mark),
`counts:<id>` and `lease:<id>` (the holder's name, expiring unless renewed).
"""

from __future__ import annotations

from typing import Any

import orjson

from .batch_store import ACTIVE, Change, Held, Line, Outcome
from .redis_client import RedisClient, shown
from .store_health import StoreHealth

P = "batchserve:batches:"
_CLAIM = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
"""
_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""
PAGE = 256
"""Lines read at once looking for those not done."""


def _bytes(value: Any) -> bytes:
    """A reply the client types as bytes or str (it gives bytes: no decode_responses)."""
    return value if isinstance(value, bytes) else str(value).encode()


def _scope(owner: str) -> str:
    return f"{len(owner)}:{owner}"


class RedisBatches:
    def __init__(self, url: str) -> None:
        self._client = RedisClient(
            url, StoreHealth("batch store", f"--result-store {shown(url)} (batches)")
        )
        self._redis = self._client.redis
        self._claim = self._redis.register_script(_CLAIM)
        self._release = self._redis.register_script(_RELEASE)
        self._record = self._redis.register_script(_RECORD)

    async def start(self) -> None:
        await self._client.start()

    async def close(self) -> None:
        await self._client.close()

    async def _owned(self, key: str, owner: str) -> dict[str, Any] | None:
        data = await self._client.run(self._redis.get(key))
        if data is None:
            return None
        stored: dict[str, Any] = orjson.loads(data)
        return stored if stored["owner"] == owner else None

    async def add_file(self, owner: str, file: dict[str, Any], content: bytes) -> None:
        seq = await self._client.run(self._redis.incr(P + "seq"))
        async with self._redis.pipeline(transaction=True) as pipe:
            self._put_file(pipe, owner, file, content, seq)
            await self._client.run(pipe.execute())

    @staticmethod
    def _put_file(pipe: Any, owner: str, file: dict[str, Any], content: bytes, seq: int) -> None:
        pipe.set(P + f"file:{file['id']}", orjson.dumps({"owner": owner, "object": file}))
        pipe.set(P + f"content:{file['id']}", content)
        pipe.zadd(P + f"files:{_scope(owner)}", {file["id"]: seq})

    async def file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        stored = await self._owned(P + f"file:{file_id}", owner)
        return None if stored is None else stored["object"]

    async def content(self, owner: str, file_id: str) -> bytes | None:
        if await self._owned(P + f"file:{file_id}", owner) is None:
            return None
        data = await self._client.run(self._redis.get(P + f"content:{file_id}"))
        return None if data is None else _bytes(data)

    async def _page(self, kind: str, index: str, after: str | None, limit: int) -> list[Any]:
        top: str | float = "+inf"
        if after is not None:
            score = await self._client.run(self._redis.zscore(index, after))
            if score is None:
                return []
            top = f"({score}"
        ids = await self._client.run(self._redis.zrevrangebyscore(index, top, "-inf", 0, limit))
        if not ids:
            return []
        found = await self._client.run(
            self._redis.mget([P + f"{kind}:{_bytes(i).decode()}" for i in ids])
        )
        return [orjson.loads(data)["object"] for data in found if data is not None]

    async def files(self, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        return await self._page("file", P + f"files:{_scope(owner)}", after, limit)

    async def delete_file(self, owner: str, file_id: str) -> bool:
        if await self._owned(P + f"file:{file_id}", owner) is None:
            return False
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(P + f"file:{file_id}", P + f"content:{file_id}")
            pipe.zrem(P + f"files:{_scope(owner)}", file_id)
            await self._client.run(pipe.execute())
        return True

    async def add_batch(
        self, owner: str, tier: str | None, batch: dict[str, Any], lines: list[bytes]
    ) -> None:
        seq = await self._client.run(self._redis.incr(P + "seq"))
        batch_id = batch["id"]
        async with self._redis.pipeline(transaction=True) as pipe:
            for start in range(0, len(lines), 1000):
                pipe.rpush(P + f"lines:{batch_id}", *lines[start : start + 1000])
            stored = {"owner": owner, "tier": tier, "object": batch}
            pipe.set(P + f"batch:{batch_id}", orjson.dumps(stored))
            pipe.zadd(P + f"list:{_scope(owner)}", {batch_id: seq})
            if batch["status"] in ACTIVE:
                pipe.sadd(P + "active", batch_id)
            await self._client.run(pipe.execute())

    async def _counted(self, batch: dict[str, Any]) -> dict[str, Any]:
        batch_id = batch["id"]
        total = await self._client.run(self._redis.llen(P + f"lines:{batch_id}"))
        if total:
            completed, failed = await self._client.run(
                self._redis.hmget(P + f"counts:{batch_id}", ["completed", "failed"])
            )
            batch["request_counts"] = {
                "total": total,
                "completed": int(completed or 0),
                "failed": int(failed or 0),
            }
        return batch

    async def batch(self, owner: str, batch_id: str) -> dict[str, Any] | None:
        stored = await self._owned(P + f"batch:{batch_id}", owner)
        return None if stored is None else await self._counted(stored["object"])

    async def batches(self, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        page = await self._page("batch", P + f"list:{_scope(owner)}", after, limit)
        return [await self._counted(batch) for batch in page]

    async def update(self, batch_id: str, change: Change) -> dict[str, Any] | None:
        return await self._write(None, batch_id, [], change, None)

    async def finish(
        self,
        owner: str,
        batch_id: str,
        files: list[tuple[dict[str, Any], bytes]],
        change: Change,
        *,
        holder: str,
    ) -> dict[str, Any] | None:
        return await self._write(owner, batch_id, files, change, holder)

    async def _write(
        self,
        owner: str | None,
        batch_id: str,
        files: list[tuple[dict[str, Any], bytes]],
        change: Change,
        holder: str | None,
    ) -> dict[str, Any] | None:
        """Applies `change` and adds `files` in one transaction; with a `holder`, only
        while it holds the lease (watched, so a takeover meanwhile retries the check)."""
        key, lease = P + f"batch:{batch_id}", P + f"lease:{batch_id}"
        seqs = [await self._client.run(self._redis.incr(P + "seq")) for _ in files]

        async def write(pipe: Any) -> dict[str, Any] | None:
            data = await pipe.get(key)
            if data is None:
                return None
            if holder is not None and await pipe.get(lease) != holder.encode():
                return None
            stored = orjson.loads(data)
            changed = change(stored["object"])
            if changed is None:
                return stored["object"]  # type: ignore[no-any-return]
            pipe.multi()
            for (file, content), seq in zip(files, seqs, strict=True):
                self._put_file(pipe, stored["owner"] if owner is None else owner, file,
                               content, seq)  # fmt: skip
            pipe.set(key, orjson.dumps(stored | {"object": changed}))
            if changed["status"] not in ACTIVE:
                pipe.srem(P + "active", batch_id)
                pipe.delete(lease)
            return changed

        found = await self._client.run(
            self._redis.transaction(write, key, lease, value_from_callable=True)
        )
        return None if found is None else await self._counted(found)

    async def claim(self, holder: str, lease_s: float) -> list[Held]:
        lease_ms = max(1, round(lease_s * 1e3))
        held: list[Held] = []
        for raw in await self._client.run(self._redis.smembers(P + "active")):
            batch_id = _bytes(raw).decode()
            if await self._client.run(
                self._claim(keys=[P + f"lease:{batch_id}"], args=[holder, lease_ms])
            ):
                data = await self._client.run(self._redis.get(P + f"batch:{batch_id}"))
                if data is not None:
                    stored = orjson.loads(data)
                    held.append(Held(batch_id, stored["owner"], stored["tier"]))
        return held

    async def release(self, batch_id: str, holder: str) -> None:
        await self._client.run(self._release(keys=[P + f"lease:{batch_id}"], args=[holder]))

    async def pending(self, batch_id: str, after: int, limit: int) -> list[Line]:
        found: list[Line] = []
        start = after + 1
        while len(found) < limit:
            page = await self._client.run(
                self._redis.lrange(P + f"lines:{batch_id}", start, start + PAGE - 1)
            )
            if not page:
                break
            positions = list(range(start, start + len(page)))
            done = await self._client.run(self._redis.hmget(P + f"done:{batch_id}", positions))
            found += [
                Line(position, _bytes(request))
                for position, request, outcome in zip(positions, page, done, strict=True)
                if outcome is None
            ]
            start += len(page)
        return found[:limit]

    async def record(self, batch_id: str, index: int, outcome: Outcome) -> bool:
        value = (b"1" if outcome.failed else b"0") + outcome.line
        field = "failed" if outcome.failed else "completed"
        keys = [P + f"done:{batch_id}", P + f"counts:{batch_id}"]
        return bool(await self._client.run(self._record(keys=keys, args=[index, value, field])))

    async def outcomes(self, batch_id: str) -> list[Outcome]:
        done = await self._client.run(self._redis.hgetall(P + f"done:{batch_id}"))
        return [
            Outcome(_bytes(value)[:1] == b"1", _bytes(value)[1:])
            for _, value in sorted(done.items(), key=lambda item: int(item[0]))
        ]
