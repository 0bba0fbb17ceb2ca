"""batchserve.client against live servers: every endpoint, a Unix socket, a 503 retried
after Retry-After with the same request id, and a deadline that runs out while retrying."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web

from batchserve.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    Inference,
    InvalidRequest,
    Unavailable,
    UnexpectedAnswer,
    _Attempts,
)

from .conftest import HANG_GUARD_S, ROOT, RealServer, real_server

MODELS = (
    '[[model]]\nname = "tiny"\nversion = "1"\n'
    'fn_per_device = "tests.sample_models:tiny_embedder"\ndevices = "sim:1"\n'
    '[[model]]\nname = "words"\nversion = "1"\nfn = "tests.sample_models:shout"\n'
    '[[model]]\nname = "writer"\nversion = "1"\ngenerator = "sim"\n'
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_attempts_send_the_time_left_and_never_wait_past_the_deadline() -> None:
    clock = FakeClock()
    attempts = _Attempts(2.0, clock, random.Random(1), "fixed-id")
    clock.now += 0.5
    assert attempts.headers() == {"X-Request-Id": "fixed-id", "X-Request-Timeout-Ms": "1500"}
    assert attempts.check(200, b"{}") is None
    overloaded = b'{"error": "OVERLOADED", "message": "full", "retry_after_ms": 400}'
    wait = attempts.check(503, overloaded)
    assert wait is not None
    assert 0.4 <= wait <= 0.6  # the server's 400 ms, with up to 50 % jitter
    clock.now += 1.2  # 0.3 s left: the next 400 ms wait would cross the deadline
    with pytest.raises(DeadlineExceeded) as raised:
        attempts.check(503, overloaded)
    assert isinstance(raised.value.last_error, Unavailable)
    assert raised.value.last_error.code == "OVERLOADED"
    with pytest.raises(InvalidRequest) as refused:
        attempts.check(400, b'{"error": "INVALID_INPUT", "message": "no", "request_id": "r"}')
    assert (refused.value.status, refused.value.code, refused.value.request_id) == (
        400, "INVALID_INPUT", "r",
    )  # fmt: skip
    clock.now += 1.0
    with pytest.raises(DeadlineExceeded):
        attempts.headers()


def test_a_resent_submit_that_meets_its_own_id_was_accepted_the_first_time() -> None:
    duplicate = b'{"error": "DUPLICATE_REQUEST_ID", "message": "in use", "request_id": "s"}'
    submit = _Attempts(10.0, FakeClock(), random.Random(1), "s")
    submit.submitting = True
    with pytest.raises(InvalidRequest):  # not resent: a real clash with another call
        submit.check(409, duplicate)
    assert 0 < submit.refused(httpx.ReadError("closed before the answer")) < 10
    assert submit.check(409, duplicate) is None
    infer = _Attempts(10.0, FakeClock(), random.Random(1), "s")
    infer.refused(httpx.ReadError("closed before the answer"))
    with pytest.raises(InvalidRequest):  # an inference's id in flight: not its answer
        infer.check(409, duplicate)


async def test_the_blocking_client_covers_every_endpoint(tmp_path) -> None:
    models = tmp_path / "models.toml"
    models.write_text(MODELS)
    async with real_server("--models", str(models), "--sim-step-ms", "1,0") as server:

        def calls() -> None:
            with Client(server.url, timeout=20) as client:
                answer = client.infer("hello", model="words", request_id="mine-1")
                assert (answer.output, answer.request_id, answer.model) == (
                    "HELLO", "mine-1", "words",
                )  # fmt: skip
                request_id = client.submit("later", model="words")
                status = client.poll(request_id, wait=10)
                while status.status in {"queued", "running"}:  # only if 10 s were not enough
                    status = client.poll(request_id, wait=10)
                assert status.result is not None
                assert status.result.output == "LATER"
                assert client.embed(["a banana", "cat"], model="tiny") == [
                    [8.0, 4.0, 0.5],
                    [3.0, 1.0, 0.5],
                ]
                whole = client.generate("abcdef", model="writer", max_tokens=4)
                assert (whole.output, whole.tokens, whole.finish_reason) == ("fedc", 4, "length")
                assert "".join(client.stream("abcdef", model="writer", max_tokens=4)) == "fedc"
                with pytest.raises(InvalidRequest) as unknown:
                    client.infer("x", model="nope")
                assert (unknown.value.status, unknown.value.code) == (404, "MODEL_NOT_FOUND")

        await asyncio.to_thread(calls)


async def test_the_async_client_serves_a_sidecar_over_a_unix_socket(tmp_path) -> None:
    path = str(tmp_path / "batchserve.sock")
    async with real_server("--uds", path, "--tcp", "off", "--devices", "sim:1") as server:
        assert server.banner.startswith(f"batchserve listening on unix:{path} ")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        async with AsyncClient(uds=path) as client:
            answers = await asyncio.gather(*(client.infer(f"in-{n}") for n in range(20)))
            assert [a.output for a in answers] == [f"in-{n}"[::-1] for n in range(20)]
            request_id = await client.submit("later")
            status = await client.poll(request_id, wait=10)
            while status.status in {"queued", "running"}:  # only if 10 s were not enough
                status = await client.poll(request_id, wait=10)
            assert status.result is not None
            assert status.result.output == "retal"
        server.process.terminate()
        assert await server.process.wait() == 0
    assert not await asyncio.to_thread(os.path.exists, path)


class DeviceGate:
    """The test's ends of `fifo_gated`'s FIFOs: when a call has entered the device, and
    letting the next n calls finish.

    Opened read-write, so neither side ever waits for the other to open: a call waits only
    for its byte.
    """

    def __init__(self, folder: Path) -> None:
        self._ends = []
        for name in ("entered", "release"):
            os.mkfifo(folder / name)
            self._ends.append(os.open(folder / name, os.O_RDWR))

    async def entered(self) -> None:
        """Returns once a call has entered the device (read from its line, not polled)."""
        line = b""
        while not line.endswith(b"\n"):
            line += await asyncio.to_thread(os.read, self._ends[0], 1)

    def release(self, calls: int) -> None:
        os.write(self._ends[1], b"g" * calls)

    def close(self) -> None:
        for end in self._ends:
            os.close(end)


async def answered(server: RealServer, request_id: str, status: int) -> None:
    """Reads the server's access log (stdout) until it has answered `request_id` with
    `status`: the server says so itself, so nothing is polled."""
    assert server.process.stdout is not None
    while True:
        line = json.loads(await server.process.stdout.readline())
        if (line["request_id"], line["status"]) == (request_id, status):
            return


async def queued_behind_one(
    client: AsyncClient, gate: DeviceGate
) -> tuple[asyncio.Task[Inference], str]:
    """Two requests: one held in the gated device's only batch, then one submitted into the
    queue of one (its 202 says it is queued). Both stay there until the device is released;
    the second's id is returned, for polling."""
    held = asyncio.create_task(client.infer("held-0"))
    await gate.entered()
    return held, await client.submit("held-1")


async def both_answered(client: AsyncClient, held: asyncio.Task[Inference], queued: str) -> None:
    assert (await held).output == "0-dleh"
    status = await client.poll(queued, wait=10)
    while status.status in {"queued", "running"}:  # only if 10 s were not enough
        status = await client.poll(queued, wait=10)
    assert status.result is not None
    assert status.result.output == "1-dleh"


OVERLOADABLE = ("--devices", "sim:1", "--max-batch-size", "1", "--max-queue", "1",
                "--fn-per-device", "tests.sample_models:fifo_gated",
                "--access-log", "on")  # fmt: skip


@contextlib.asynccontextmanager
async def overloadable(tmp_path: Path) -> AsyncIterator[tuple[RealServer, AsyncClient, DeviceGate]]:
    """A real server whose one device is gated (its access log on stdout), a client, and
    the gate."""
    gate = DeviceGate(tmp_path)
    try:
        async with (
            asyncio.timeout(HANG_GUARD_S),
            real_server(*OVERLOADABLE, env={"BATCHSERVE_TEST_FIFOS": str(tmp_path)}) as server,
            AsyncClient(server.url) as client,
        ):
            yield server, client, gate
    finally:
        gate.close()


async def test_a_503_is_retried_after_its_retry_after_under_the_same_request_id(tmp_path) -> None:
    async with overloadable(tmp_path) as (server, client, gate):
        held, queued = await queued_behind_one(client, gate)
        third = asyncio.create_task(client.infer("third", request_id="retried"))
        await answered(server, "retried", 503)
        gate.release(3)
        answer = await third
        assert (answer.output, answer.request_id) == ("driht", "retried")
        await both_answered(client, held, queued)


async def test_a_deadline_that_runs_out_while_retrying_raises_deadline_exceeded(tmp_path) -> None:
    async with overloadable(tmp_path) as (_, client, gate):
        held, queued = await queued_behind_one(client, gate)
        with pytest.raises(DeadlineExceeded) as raised:
            await client.infer("third", timeout=0.5)
        assert isinstance(raised.value.last_error, Unavailable)
        assert raised.value.last_error.code == "OVERLOADED"
        gate.release(2)
        await both_answered(client, held, queued)


async def test_an_answer_without_a_field_is_a_typed_error_or_none(aiohttp_server) -> None:
    """A 200 from an older server (no model, version, latency or batch size) is read with
    those None; one without what the call needs (a proxy's page) raises UnexpectedAnswer,
    never a bare KeyError."""
    answers = {
        "/api/inference": {"output": "olleh"},
        "/api/requests": {"status": "queued"},
        "/api/requests/r1": {"request_id": "r1", "status": "completed", "output": "x"},
        "/api/requests/r2": {"request_id": "r2"},
        "/api/requests/r3": {"request_id": "r3", "status": "failed", "error": "BROKEN"},
        "/v1/embeddings": {"data": [{"index": 0}]},
        "/api/generate": {"output": "abc"},
    }

    async def answer(request: web.Request) -> web.Response:
        if request.can_read_body and (await request.json()).get("input") == "via a proxy":
            return web.Response(text="<html>welcome</html>", content_type="text/html")
        return web.json_response(answers[request.path])

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", answer)
    server = await aiohttp_server(app)
    url = str(server.make_url(""))
    async with AsyncClient(url) as client:
        old = await client.infer("hello", request_id="mine")
        assert old == Inference("olleh", "mine", None, None, None, None)
        assert await client.submit("x", request_id="sent") == "sent"
        done = await client.poll("r1")
        assert done.result is not None
        assert done.result.output == "x"
        assert (await client.poll("r3")).error is not None
        for call in (
            client.poll("r2"),
            client.embed(["a"]),
            client.generate("abc"),
        ):
            with pytest.raises(UnexpectedAnswer) as caught:
                await call
            assert caught.value.code == "UNEXPECTED_ANSWER"
        with pytest.raises(UnexpectedAnswer, match="no 'output' field"):
            await client.infer("via a proxy")

    def blocking() -> None:
        with Client(url) as client:
            assert client.infer("hello").model is None
            with pytest.raises(UnexpectedAnswer, match="no 'status' field"):
                client.poll("r2")

    await asyncio.to_thread(blocking)


# The client is outside the server: httpx comes with `batchserve[client]`, never with the server.


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_importing_the_server_never_imports_httpx() -> None:
    run = python(
        "import sys, batchserve, batchserve.cli, batchserve.server\n"
        "assert 'httpx' not in sys.modules, 'httpx imported'"
    )
    assert run.returncode == 0, run.stderr


async def test_a_running_server_never_imports_httpx(tmp_path: Path) -> None:
    """Every module the server imports, at start-up and while answering, is in its
    -X importtime log (PYTHONPROFILEIMPORTTIME), written to a file so no pipe fills."""
    log = tmp_path / "imports.log"
    with log.open("w") as stderr:
        async with real_server(
            "--devices", "sim:1", env={"PYTHONPROFILEIMPORTTIME": "1"}, stderr=stderr.fileno()
        ) as server:
            async with aiohttp.ClientSession() as session:
                async with session.post(
                    f"{server.url}/api/inference", json={"input": "hello"}
                ) as answer:
                    assert (await answer.json())["output"] == "olleh"
                async with session.get(f"{server.url}/metrics") as answer:
                    assert answer.status == 200
            server.process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(server.process.wait(), HANG_GUARD_S) == 0
    imported = {line.rsplit("|", 1)[1].strip() for line in log.read_text().splitlines()
                if line.startswith("import time:")}  # fmt: skip
    assert "batchserve.server" in imported
    assert not {name for name in imported if name.split(".")[0] == "httpx"}


def test_the_client_without_httpx_says_which_extra_to_install() -> None:
    run = python("import sys\nsys.modules['httpx'] = None\nimport batchserve.client")
    assert run.returncode == 1
    assert "ImportError: batchserve.client needs httpx" in run.stderr, run.stderr
    assert "pip install 'batchserve[client]'" in run.stderr
