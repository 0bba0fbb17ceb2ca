"""HTTP/1.1 on a bare socket, for what a client library will not send: bytes that are not
UTF-8, malformed heads, pipelined requests, bodies that stop half-way."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import orjson

from .conftest import HANG_GUARD_S


class Answer(NamedTuple):
    status: int
    headers: dict[str, str]
    """Header names lower-cased; a repeated header keeps its last value."""
    body: bytes

    def json(self) -> dict[str, object]:
        decoded = orjson.loads(self.body)
        assert isinstance(decoded, dict), decoded
        return decoded


def post(path: str, body: bytes, *headers: bytes) -> bytes:
    """A POST with a Content-Length and the extra header lines given."""
    lines = b"".join(line + b"\r\n" for line in headers)
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (
        path.encode(),
        len(body),
        lines,
        body,
    )


async def read_answer(reader: asyncio.StreamReader) -> Answer | None:
    """The next answer on the connection (a 1xx one included), or None at end of stream."""
    async with asyncio.timeout(HANG_GUARD_S):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise AssertionError(f"the stream ended inside a head: {exc.partial!r}") from None
            return None
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in filter(None, lines):
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(status_line.split()[1])
        length = int(headers.get("content-length", "0"))
        return Answer(status, headers, await reader.readexactly(length))


async def read_answers(reader: asyncio.StreamReader) -> list[Answer]:
    """Every answer until the server closes the connection (bounded by the hang guard)."""
    answers = []
    while (answer := await read_answer(reader)) is not None:
        answers.append(answer)
    return answers


async def exchange(host: str, port: int, data: bytes) -> list[Answer]:
    """Sends `data` in one write on a new connection, then reads answers until the server
    closes it (the last request should say `Connection: close`)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        return await read_answers(reader)
    finally:
        writer.close()
        await writer.wait_closed()
