"""doors/connections.py against a live in-process server, over bare sockets: each deadline closes
what it bounds, the body budget refuses what does not fit, aiohttp's own refusals are the
API's JSON, and a malformed request costs only itself.

Deadlines run on the loop's clock: the one under test is set tiny, the others a day, and a
test waits for the close itself (reading to end of stream, bounded by the hang guard)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

import pytest
from aiohttp.test_utils import TestClient

from batchserve.doors.connections import ConnectionServer
from batchserve.models.backends import simulated_factory

from . import raw_http
from .conftest import HANG_GUARD_S

DAY = 86_400.0
LONG = {
    "header_timeout_s": DAY,
    "body_timeout_s": DAY,
    "keepalive_timeout_s": DAY,
    "write_timeout_s": DAY,
}
BODY = b'{"input": "abc"}'


async def serve(start_server: Callable[..., object], **settings: object) -> TestClient:
    client, _ = await start_server(simulated_factory(0.0, 100), **{**LONG, **settings})  # type: ignore[operator]
    return client


def connections(client: TestClient) -> ConnectionServer:
    server = client.server.runner.server  # type: ignore[union-attr]
    assert isinstance(server, ConnectionServer)
    return server


async def until(holds: Callable[[], bool]) -> None:
    """Waits for a state of the server that no event announces, bounded by the hang guard."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not holds():  # noqa: ASYNC110
            await asyncio.sleep(0)


async def closed_unanswered(reader: asyncio.StreamReader) -> bool:
    """True once the server closed the connection without writing a byte."""
    async with asyncio.timeout(HANG_GUARD_S):
        return await reader.read() == b""


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # a connection that sends nothing
        b"GET /healthz HT",  # a partial request line
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: a",  # partial headers
    ],
)
async def test_a_head_that_does_not_arrive_whole_in_time_closes_its_connection(start_server, sent):
    client = await serve(start_server, header_timeout_s=0.01)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(sent)
    assert await closed_unanswered(reader)
    writer.close()


@pytest.mark.parametrize(
    "sent",
    [
        raw_http.post("/api/inference", BODY)[:-4],  # shorter than its Content-Length
        b"POST /api/inference HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"10\r\n" + BODY,  # a chunked body without its last chunk
    ],
)
async def test_a_body_that_stalls_closes_its_connection_and_frees_its_bytes(start_server, sent):
    client = await serve(start_server, body_timeout_s=0.01)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(sent)
    assert await closed_unanswered(reader)
    await until(lambda: not connections(client).connections)
    assert connections(client).budget.held == 0
    writer.close()


async def test_an_idle_keep_alive_connection_is_closed_after_its_answer(start_server):
    client = await serve(start_server, keepalive_timeout_s=0.01)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(raw_http.post("/api/inference", BODY))
    answer = await raw_http.read_answer(reader)
    assert answer is not None
    assert answer.status == 200
    assert await closed_unanswered(reader)
    writer.close()


async def test_a_client_that_never_reads_is_cut_off_after_the_write_deadline(start_server, caplog):
    """The client asks for far more than the socket buffers hold, and reads none of it."""
    caplog.set_level(logging.INFO, logger="batchserve.connections")
    client = await serve(start_server, write_timeout_s=0.01)
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, (client.host, client.port))
    big = raw_http.post("/api/inference", b'{"input": "%s"}' % (b"a" * 200_000))
    with contextlib.suppress(ConnectionError):  # the server may cut it off mid-send
        for _ in range(20):  # 4 MB of answers
            await loop.sock_sendall(sock, big)
    await until(lambda: "write deadline passed" in caplog.text)
    await until(lambda: not connections(client).connections)
    sock.close()


async def test_bodies_past_the_budget_get_503_and_a_closed_connection(start_server):
    client = await serve(start_server, max_unfinished_body_bytes=len(BODY) + 10)
    budget = connections(client).budget
    first_reader, first = await asyncio.open_connection(client.host, client.port)
    first.write(raw_http.post("/api/inference", BODY)[:-2])  # its body still arriving
    await until(lambda: budget.held == len(BODY))
    refused = await raw_http.exchange(  # read until the server closes it
        client.host, client.port, raw_http.post("/api/inference", BODY)[:-2]
    )
    assert [(a.status, a.json()["error"]) for a in refused] == [(503, "OVERLOADED")]
    assert refused[0].headers["retry-after"] == "1"
    first.write(b'"}')  # the rest of the first body
    answer = await raw_http.read_answer(first_reader)
    assert answer is not None
    assert (answer.status, answer.json()["output"]) == (200, "cba")
    assert budget.held == 0
    again = raw_http.post("/api/inference", BODY, b"Connection: close")
    assert [a.status for a in await raw_http.exchange(client.host, client.port, again)] == [200]
    first.close()


@pytest.mark.parametrize(
    "sent",
    [
        b"POST /api/inference HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /api/inference HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n",
        b"BREW /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40,  # TLS on the port
    ],
)
async def test_what_aiohttp_cannot_parse_gets_json_an_id_and_one_log_line(
    start_server, caplog, sent
):
    caplog.set_level(logging.DEBUG)
    client = await serve(start_server)
    [answer] = await raw_http.exchange(client.host, client.port, sent)
    assert answer.status == 400
    body = answer.json()
    assert body["error"] == "INVALID_INPUT"
    assert body["message"].startswith("a malformed HTTP request: ")
    assert answer.headers["x-request-id"] == body["request_id"]
    assert answer.headers["content-type"] == "application/json"
    # aiohttp's access log aside (the test server's; `batchserve` serves without it)
    logged = [r for r in caplog.records if r.name != "aiohttp.access"]
    refusals = [r for r in logged if r.name.startswith(("aiohttp", "batchserve"))]
    assert [r.name for r in refusals] == ["batchserve.connections"]
    assert refusals[0].exc_info is None
    assert len(refusals[0].getMessage()) < 400


@pytest.mark.parametrize(
    "first",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        raw_http.post("/api/inference", BODY),
        raw_http.post("/api/inference", BODY) * 3,
    ],
)
async def test_a_malformed_request_after_good_ones_in_one_segment_costs_only_itself(
    start_server, first
):
    client = await serve(start_server)
    malformed = b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n"
    answers = await raw_http.exchange(client.host, client.port, first + malformed)
    good = first.count(b"HTTP/1.1")
    assert [a.status for a in answers] == [200] * good + [400]
    assert answers[-1].json()["error"] == "INVALID_INPUT"
