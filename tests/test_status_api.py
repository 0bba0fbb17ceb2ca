"""Submit, then poll: POST /api/requests and GET /api/requests/{id}, in-process."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient

from batchserve.clock import FakeClock
from batchserve.doors.status_api import MAX_WAIT_MS
from batchserve.models.backends import POISON_MARKER, simulated_factory

from .conftest import HANG_GUARD_S, reach


async def poll(client: TestClient, request_id: str, wait_ms: float = 0) -> dict[str, object]:
    query = f"?wait_ms={wait_ms}" if wait_ms else ""
    response = await client.get(f"/api/requests/{request_id}{query}")
    assert response.status == 200
    return dict(await response.json())


async def poll_until_done(client: TestClient, request_id: str) -> dict[str, object]:
    """Long polls, each held by the server until the request ends (or a minute passes)."""
    for _ in range(10):
        answer = await poll(client, request_id, wait_ms=MAX_WAIT_MS)
        if answer["status"] in {"completed", "failed"}:
            return answer
    raise AssertionError(f"{request_id} never finished")


async def submit(client: TestClient, text: str, **headers: str) -> str:
    response = await client.post("/api/requests", json={"input": text}, headers=headers)
    assert response.status == 202
    body = await response.json()
    assert body["status"] == "queued"
    assert response.headers["Location"] == f"/api/requests/{body['request_id']}"
    return str(body["request_id"])


async def test_a_request_goes_queued_running_completed(start_server, gated):
    client, engine = await start_server(gated)
    first = await submit(client, "first")
    await reach(engine, lambda s: s.in_flight == 1)
    second = await submit(client, "second")
    assert (await poll(client, first))["status"] == "running"
    assert (await poll(client, second))["status"] == "queued"
    gated.gate.set()
    done = await poll_until_done(client, second)
    assert done["status"] == "completed"
    assert done["output"] == "dnoces"
    assert done["request_id"] == second
    assert {"latency_ms", "queue_ms", "compute_ms", "batch_size"} <= done.keys()
    assert (await poll_until_done(client, first))["output"] == "tsrif"
    assert engine.stats().pending == 0


async def test_a_waiting_poll_answers_as_soon_as_its_request_ends(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(gated, clock=clock)
    request_id = await submit(client, "held")
    await reach(engine, lambda s: s.in_flight == 1)
    waiting = asyncio.ensure_future(poll(client, request_id, wait_ms=1000))
    await until_a_timer_at(clock, clock.time() + 1.0)  # the poll waits
    assert not waiting.done()
    gated.gate.set()  # no clock time passes: the answer ends the wait
    async with asyncio.timeout(HANG_GUARD_S):
        done = await waiting
    assert (done["status"], done["output"]) == ("completed", "dleh")


async def test_a_waiting_poll_answers_the_status_once_wait_ms_has_passed(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(gated, clock=clock)
    request_id = await submit(client, "held")
    await reach(engine, lambda s: s.in_flight == 1)
    start = clock.time()
    waiting = asyncio.ensure_future(poll(client, request_id, wait_ms=250))
    await until_a_timer_at(clock, start + 0.250)
    clock.advance(0.249)
    await asyncio.sleep(0)
    assert not waiting.done()
    clock.advance(0.001)
    assert (await waiting)["status"] == "running"
    gated.gate.set()
    assert (await poll_until_done(client, request_id))["output"] == "dleh"


async def test_wait_ms_must_be_a_number_of_ms_up_to_the_limit(start_server, gated):
    gated.gate.set()
    client, _ = await start_server(gated)
    request_id = await submit(client, "x")
    for wait_ms in ("soon", "-1", "nan", "inf", str(MAX_WAIT_MS + 1)):
        refused = await client.get(f"/api/requests/{request_id}?wait_ms={wait_ms}")
        assert (refused.status, (await refused.json())["error"]) == (400, "INVALID_INPUT")
    unknown = await client.get(f"/api/requests/nobody?wait_ms={MAX_WAIT_MS}")
    assert unknown.status == 404  # at once: nothing to wait for


async def until_a_timer_at(clock: FakeClock, when: float) -> None:
    """Lets the loop run until the first timer is the one armed for `when` (the poll's
    wait, before the request's deadline)."""
    for _ in range(10_000):
        if clock.next_timer() == when:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"no timer was armed for {when}")


async def test_a_failing_request_reports_its_error(start_server, gated):
    gated.gate.set()
    client, _ = await start_server(gated)
    request_id = await submit(client, f"bad{POISON_MARKER}")
    failed = await poll_until_done(client, request_id)
    assert failed["status"] == "failed"
    assert failed["error"]["error"] == "BACKEND_ERROR"  # type: ignore[index]
    assert "poison" in failed["error"]["message"]  # type: ignore[index]


async def test_a_deadline_passes_while_queued(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(gated, clock=clock)
    response = await client.post("/api/requests", json={"input": "slow", "timeout_ms": 20})
    request_id = (await response.json())["request_id"]
    assert (await poll(client, request_id))["status"] in {"queued", "running"}
    clock.advance(0.020)
    failed = await poll_until_done(client, request_id)
    assert failed["error"]["error"] == "DEADLINE_EXCEEDED"  # type: ignore[index]
    gated.gate.set()
    assert engine.stats().pending == 0


async def test_unknown_duplicate_invalid_and_expired_ids(start_server, gated):
    client, _ = await start_server(gated, result_ttl_s=0)
    missing = await client.get("/api/requests/nobody")
    assert missing.status == 404
    assert (await missing.json())["error"] == "NOT_FOUND"
    await submit(client, "x", **{"X-Request-Id": "mine"})
    again = await client.post(
        "/api/requests", json={"input": "y"}, headers={"X-Request-Id": "mine"}
    )
    assert again.status == 409
    bad = await client.post("/api/requests", data=b"not json")
    assert (bad.status, (await bad.json())["error"]) == (400, "INVALID_INPUT")
    gated.gate.set()
    for _ in range(10_000):  # result_ttl_s=0: gone as soon as it has finished
        if (await client.get("/api/requests/mine")).status == 404:
            break
        await asyncio.sleep(0)
    else:
        raise AssertionError("the finished result never expired")


async def test_many_submitted_requests_each_get_their_own_answer(start_server):
    client, engine = await start_server(simulated_factory(0.002, 100), devices=2)
    texts = [f"async-{n}" for n in range(300)]
    ids = await asyncio.gather(*(submit(client, text) for text in texts))
    answers = [await poll_until_done(client, request_id) for request_id in ids]
    assert [answer["output"] for answer in answers] == [text[::-1] for text in texts]
    assert engine.stats().pending == 0


class FakeRedis:
    """Just enough of Redis's wire protocol (RESP2) for the Redis result store: PING, SET
    (NX, PX), GET, DEL, and +OK to anything else (the client's CLIENT SETINFO). `stop` closes
    the listener and every connection, as a Redis that went down would; `start` again serves
    on the same port (and the same keys)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while header := await reader.readline():
                args = []
                for _ in range(int(header[1:])):
                    size = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(size + 2))[:-2])
                writer.write(self._answer(args))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def _answer(self, args: list[bytes]) -> bytes:
        command, *rest = args
        command = command.upper()
        if command == b"PING":
            return b"+PONG\r\n"
        if command == b"GET":
            value = self.data.get(rest[0])
            return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)
        if command == b"SET":
            key, value, *options = rest
            if b"NX" in (option.upper() for option in options) and key in self.data:
                return b"$-1\r\n"
            self.data[key] = value
            return b"+OK\r\n"
        if command == b"DEL":
            return b":%d\r\n" % (self.data.pop(rest[0], None) is not None)
        return b"+OK\r\n"


async def test_a_result_store_that_goes_down_is_a_json_503_and_unready(start_server, gated):
    gated.gate.set()
    redis = FakeRedis()
    await redis.start()
    client, _ = await start_server(gated, result_store=f"redis://127.0.0.1:{redis.port}/0")
    done = await submit(client, "before")
    assert (await poll_until_done(client, done))["output"] == "erofeb"
    assert (await client.get("/readyz")).status == 200
    await redis.stop()

    refused = await client.post("/api/requests", json={"input": "x"})
    assert refused.status == 503
    assert refused.headers["Retry-After"] == "1"
    body = await refused.json()
    assert body["error"] == "STORE_UNAVAILABLE"
    assert "redis" not in body["message"].lower()  # no address for clients
    assert (await poll(client, done))["status"] == "completed"  # still held in memory
    unknown = await client.get("/api/requests/elsewhere")
    assert unknown.status == 503
    assert unknown.headers["Retry-After"] == "1"
    assert (await unknown.json())["error"] == "STORE_UNAVAILABLE"
    ready = await client.get("/readyz")
    assert ready.status == 503
    ready_body = await ready.json()
    assert ready_body["status"] == "result store unavailable"
    assert "ConnectionError" in ready_body["result_store"]

    await redis.start()  # back: ready again, and submits are taken
    assert (await client.get("/readyz")).status == 200
    again = await submit(client, "after")
    assert (await poll_until_done(client, again))["output"] == "retfa"
    await redis.stop()  # the server's own shutdown writes nothing more


async def test_a_status_store_full_in_bytes_answers_503_with_retry_after(start_server, gated):
    client, _ = await start_server(gated, result_store_bytes=3000, max_input_bytes=2000)
    first = await client.post("/api/requests", json={"input": "a" * 2000})
    assert first.status == 202
    refused = await client.post("/api/requests", json={"input": "b" * 2000})
    assert refused.status == 503
    assert (await refused.json())["error"] == "OVERLOADED"
    assert refused.headers["Retry-After"] == "1"
    gated.gate.set()
    request_id = (await first.json())["request_id"]
    done = await client.get(f"/api/requests/{request_id}?wait_ms=60000")
    assert (await done.json())["status"] == "completed"
    again = await client.post("/api/requests", json={"input": "c" * 2000})
    assert again.status == 202  # the finished answer made room
