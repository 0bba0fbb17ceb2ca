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

from batchserve.config import Config
from batchserve.doors.body_budget import client_address
from batchserve.doors.connections import ConnectionServer, body_due
from batchserve.models.backends import simulated_factory

from . import raw_http
from .conftest import HANG_GUARD_S, until

DAY = 86_400.0
LONG = {
    "header_timeout_s": DAY,
    "body_timeout_s": DAY,
    "body_deadline_s": DAY,
    "body_min_rate": 0.0,
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


def cut_at(settings: Config, arrivals: list[tuple[float, int]]) -> tuple[float, str]:
    """When and by which rule a body is cut whose bytes come as `arrivals` (time after its
    head, bytes), by `body_due` as the connection applies it: the first due before the next
    arrival."""
    seen, received = 0.0, 0
    for at, size in arrivals:
        due, rule = body_due(settings, 0.0, seen, received)
        if due <= at:
            return due, rule
        seen, received = at, received + size
    return body_due(settings, 0.0, seen, received)


def test_a_trickle_that_meets_every_gap_is_cut_at_the_whole_body_deadline():
    """A byte every 20 s never stalls the 30 s gap, yet the body ends 60 s after its head."""
    settings = Config(body_timeout_s=30, body_deadline_s=60, body_min_rate=0)
    trickle = [(20.0 * n, 1) for n in range(1, 1000)]
    assert cut_at(settings, trickle) == (60.0, "whole-body")


def test_a_body_below_the_minimum_rate_is_cut_once_past_its_grace():
    """1 KiB/s after 10 s of grace: 512 B/s falls behind at 20 s; 2 KiB/s never does."""
    settings = Config(body_deadline_s=DAY, body_min_rate=1024, body_rate_grace_s=10)
    slow = [(n / 10, 51) for n in range(1, 100_000)]  # 510 B/s, a tenth of a second apart
    due, rule = cut_at(settings, slow)
    assert rule == "body rate"
    assert 19.5 < due < 20.5
    steady = [(n / 10, 205) for n in range(1, 10_000)]  # 2050 B/s, for 1,000 s
    assert cut_at(settings, steady)[0] > 1_000


@pytest.mark.parametrize(
    ("settings", "rule"),
    [
        ({"body_deadline_s": 0.01}, "whole-body"),
        ({"body_min_rate": 1e12, "body_rate_grace_s": 0.0}, "body rate"),
    ],
)
async def test_a_trickling_body_is_cut_by_its_deadline_though_no_gap_is_long(
    start_server, caplog, settings, rule
):
    """Its gap deadline is a day, and a byte comes at every turn of the loop until the
    server closes the connection."""
    caplog.set_level(logging.INFO, logger="batchserve.connections")
    client = await serve(start_server, **settings)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /api/inference HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
    closed = asyncio.ensure_future(reader.read())  # to end of stream, or a reset
    async with asyncio.timeout(HANG_GUARD_S):
        with contextlib.suppress(ConnectionError):
            while not closed.done():
                writer.write(b"a")
                await asyncio.sleep(0)
        with contextlib.suppress(ConnectionError):  # closed with bytes unread: a reset
            assert await closed == b""
    assert f"its {rule} deadline passed" in caplog.text
    await until(lambda: not connections(client).connections)
    assert connections(client).budget.held == 0
    writer.close()


@pytest.mark.parametrize("path", ["/api/inference", "/v1/chat/completions"])
async def test_with_keys_a_body_takes_the_budget_only_once_its_key_is_known(
    start_server, tmp_path, path
):
    """The budget is full, yet a body still arriving without a known key gets its route's
    own 401 (OpenAI's error shape on /v1), taking nothing, not a 503."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys."sk-1"]\ntenant = "acme"\ntier = "paid"\n')
    client = await serve(
        start_server, keys_file=str(keys), max_unfinished_body_bytes=len(BODY) + 10
    )
    budget = connections(client).budget
    held_reader, held = await asyncio.open_connection(client.host, client.port)
    held.write(raw_http.post("/api/inference", BODY, b"Authorization: Bearer sk-1")[:-2])
    await until(lambda: budget.held == len(BODY))  # the budget is full
    for key in (b"", b"Authorization: Bearer sk-wrong"):
        unkeyed = raw_http.post(path, b"a" * 100, b"X-Request-Id: nokey", key)
        [refused] = await raw_http.exchange(client.host, client.port, unkeyed[:-50])
        error = refused.json()["error"]
        code = error["code"] if isinstance(error, dict) else error
        assert (refused.status, code) == (401, "UNAUTHENTICATED")
        assert refused.headers["x-request-id"] == "nokey"
        assert budget.held == len(BODY)
    held.write(b'"}')
    answer = await raw_http.read_answer(held_reader)
    assert answer is not None
    assert answer.status == 200
    assert budget.held == 0
    held.close()


async def test_one_address_holds_at_most_its_bound_while_another_gets_through(start_server):
    client = await serve(
        start_server,
        max_unfinished_body_bytes=10 * len(BODY),
        max_unfinished_body_bytes_per_address=len(BODY) + 10,
    )
    budget = connections(client).budget
    partial = raw_http.post("/api/inference", BODY)[:-2]
    first_reader, first = await asyncio.open_connection(client.host, client.port)
    first.write(partial)
    await until(lambda: budget.held == len(BODY))
    [refused] = await raw_http.exchange(client.host, client.port, partial)
    assert (refused.status, refused.json()["error"]) == (503, "OVERLOADED")
    assert "client address" in refused.json()["message"]
    other_reader, other = await asyncio.open_connection(
        client.host, client.port, local_addr=("127.0.0.2", 0)
    )
    other.write(partial)
    await until(lambda: budget.held == 2 * len(BODY))
    assert budget.by_address == {"127.0.0.1": len(BODY), "127.0.0.2": len(BODY)}
    for reader, writer in ((first_reader, first), (other_reader, other)):
        writer.write(b'"}')
        answer = await raw_http.read_answer(reader)
        assert answer is not None
        assert answer.status == 200
        writer.close()
    assert (budget.held, budget.by_address) == (0, {})


@pytest.mark.parametrize(
    ("peername", "address"),
    [
        (("203.0.113.7", 4711), "203.0.113.7"),
        (("::ffff:203.0.113.7", 4711, 0, 0), "203.0.113.7"),
        (("2001:db8:1:2:aaaa::1", 4711, 0, 0), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:bbbb::9", 4711, 0, 0), "2001:db8:1:2::/64"),
        ("", None),  # a Unix socket
        (None, None),
    ],
)
def test_a_client_address_is_its_ipv4_address_or_its_ipv6_slash_64(peername, address):
    assert client_address(peername) == address
