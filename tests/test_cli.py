"""The command line, and the real `python -m batchserve` process as a user runs it."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
import torch

from batchserve.cli import _FLAGS, build_parser, config_from_args, serve
from batchserve.client import AsyncClient
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.errors import NotReady, StartupError

from .conftest import HANG_GUARD_S, ROOT, real_server


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchserve", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_help_explains_every_flag():
    text = " ".join(build_parser().format_help().split())
    for flag, _, _ in _FLAGS:
        assert f"--{flag}" in text
        assert f"BATCHSERVE_{flag.replace('-', '_').upper()}" in text
    switches = [f for f in dataclasses.fields(Config) if f.type == "bool"]
    assert text.count("on or off;") == len(switches) >= 5  # each names the values it takes
    assert "--metrics {on,off}" in text
    assert "off removes all three" in text  # /metrics, the dashboard at / and /api/stats


def test_usage_names_the_command_the_user_typed():
    module = run_cli("--help")
    assert module.stdout.startswith("usage: python -m batchserve ")
    script = subprocess.run(
        [sys.executable, "-c", "import sys; from batchserve.cli import main; sys.exit(main())",
         "--help"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert script.stdout.startswith("usage: batchserve ")


def test_a_port_in_use_is_one_line_naming_the_cause():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--port", str(port))
    assert result.returncode == 1
    assert result.stderr == (
        f"python -m batchserve: error: cannot listen on 127.0.0.1:{port}: address already in use\n"
    )


class FailingPolicy:
    """A batching loop that crashes on its first decision (for the first request)."""

    def decide(self, *args: object) -> object:
        raise RuntimeError("a bug in the batching loop")


async def test_the_server_exits_1_when_its_engine_fails(caplog):
    failing: Any = FailingPolicy()
    engine = Engine(Config(port=0, devices="sim:2"), policy=failing)
    serving = asyncio.ensure_future(serve(engine))
    async with asyncio.timeout(60):  # a hang guard only
        await engine.started.wait()
        ticket = engine.submit("x")
        assert await serving == 1
    assert isinstance(ticket.outcome(), NotReady)
    assert engine.readiness() == (False, "failed")
    assert "exiting 1: batchserve-batcher crashed: RuntimeError" in caplog.text


def test_flags_read_the_environment_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("BATCHSERVE_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("BATCHSERVE_POLICY", "fixed")
    config, _ = config_from_args([])
    assert config.max_batch_size == 7
    assert config.policy == "fixed"
    config, _ = config_from_args(["--max-batch-size", "9"])
    assert config.max_batch_size == 9


def test_switches_take_on_and_off_from_flags_and_the_environment(monkeypatch):
    assert config_from_args([])[0].bisect_failures is True
    monkeypatch.setenv("BATCHSERVE_BISECT_FAILURES", "off")
    assert config_from_args([])[0].bisect_failures is False
    assert config_from_args(["--bisect-failures", "on"])[0].bisect_failures is True
    with pytest.raises(SystemExit):
        config_from_args(["--bisect-failures", "maybe"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-batch-size", "101"], "max_batch_size must be between 1 and 100"),
        (["--sim-fail-rate", "0.7", "--sim-hang-rate", "0.5"], "add up to 1 at most"),
        pytest.param(
            ["--devices", "cuda"],
            "--devices cuda: torch is installed but sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here"),
        ),
        (["--devices", "cpu"], "needs a model: give --fn or --fn-per-device"),
        # A real generator on the default sim:4 is refused before it loads anything.
        (["--generator", "tests.sample_models:broken"], "add --devices cpu (or --devices cuda)"),
        (
            ["--generator", "batchserve.models.causal_lm:load", "--devices", "sim:2"],
            "batchserve.models.causal_lm:load loads a real model, which cannot run on the"
            " simulated devices sim:2",
        ),
        (["--fn", "tests.sample_models:nope"], "has no attribute nope"),
        (
            ["--fn-per-device", "tests.sample_models:broken"],
            "device sim:0 failed to load: RuntimeError: no weights found",
        ),
        (
            ["--timeout-ms", "inf", "--result-store", "redis://127.0.0.1:9/0"],
            "timeout_ms must be more than 0 and at most 86400000 (a day)",
        ),
        (
            ["--result-ttl-s", "1e300", "--result-store", "redis://127.0.0.1:9/0"],
            "result_ttl_s must be between 0 and 31536000 (a year)",
        ),
    ],
)
def test_start_up_errors_are_one_line_and_exit_1(args, message):
    result = run_cli("--port", "0", *args)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert message in result.stderr


def test_cuda_without_torch_is_a_one_line_error():
    code = (
        "import sys; sys.modules['torch'] = None; from batchserve.cli import main; "
        "sys.exit(main(['--devices', 'cuda']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 1
    assert "needs torch, which is not installed" in result.stderr


async def test_real_process_serves_then_drains_on_sigterm(tmp_path):
    os.mkfifo(tmp_path / "entered")
    os.mkfifo(tmp_path / "release")
    async with real_server(
        "--devices", "sim:1", "--fn-per-device", "tests.sample_models:fifo_gated",
        env={"BATCHSERVE_TEST_FIFOS": str(tmp_path)},
    ) as (process, banner, url):  # fmt: skip
        assert "devices=sim:0" in banner
        assert "policy=adaptive" in banner
        async with aiohttp.ClientSession(url) as session:
            in_flight = asyncio.ensure_future(session.post("/api/inference", json={"input": "abc"}))
            entered = await asyncio.to_thread((tmp_path / "entered").read_text)
            assert entered == "1\n"
            process.send_signal(signal.SIGTERM)
            # Draining, it stops taking connections (a load balancer in front then sends new
            # requests elsewhere) while the request it holds runs on.
            for _ in range(10_000):  # the signal is handled on the server's own loop
                try:
                    async with aiohttp.ClientSession(url) as fresh:
                        await fresh.get("/readyz")
                except aiohttp.ClientConnectorError:
                    break
            else:
                pytest.fail("the server still took connections after SIGTERM")
            assert not in_flight.done()
            await asyncio.to_thread((tmp_path / "release").write_text, "go\n")
            answer = await in_flight
            assert answer.status == 200
            assert (await answer.json())["output"] == "cba"
        assert await asyncio.wait_for(process.wait(), HANG_GUARD_S) == 0


async def test_real_process_exits_on_sigterm_while_a_device_is_hung():
    """A wedged call's thread cannot be killed; it must not keep the process alive."""
    async with real_server(
        "--devices", "sim:2", "--sim-latency-ms", "1", "--sim-hang-ms", "600000",
        "--batch-timeout-ms", "2000",  # the retry's 1 ms call never reaches it, loaded or not
    ) as (process, _, url):  # fmt: skip
        async with aiohttp.ClientSession(url) as session:
            answer = await session.post("/api/inference", json={"input": "x!hang!"})
            assert (await answer.json())["output"] == "!gnah!x"  # retried on the other device
            devices = (await (await session.get("/readyz")).json())["devices"]
            assert sorted(devices.values()) == ["hung", "idle"]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), HANG_GUARD_S) == 0


async def _log_line(process: asyncio.subprocess.Process, text: str) -> str:
    """The server's next log line on stderr that contains `text` (the earlier ones skipped);
    fails if the process exits first."""
    assert process.stderr is not None
    while line := (await process.stderr.readline()).decode():
        if text in line:
            return line
    pytest.fail(f"the server exited ({await process.wait()}) before logging {text!r}")


async def test_real_process_drains_through_repeated_signals(tmp_path):
    """A second SIGTERM, a SIGINT and a SIGHUP during the drain drop nothing it accepted."""
    os.mkfifo(tmp_path / "entered")
    os.mkfifo(tmp_path / "release")
    async with real_server(
        "--devices", "sim:1", "--fn-per-device", "tests.sample_models:fifo_gated",
        env={"BATCHSERVE_TEST_FIFOS": str(tmp_path)}, stderr=asyncio.subprocess.PIPE,
    ) as (process, _, url), aiohttp.ClientSession(url) as session:  # fmt: skip
        inputs = [f"in{i}" for i in range(4)]
        posts = [
            asyncio.ensure_future(session.post("/api/inference", json={"input": text}))
            for text in inputs
        ]
        entered = int(await asyncio.to_thread((tmp_path / "entered").read_text))
        for _ in range(10_000):  # until the server holds them all (one in the device)
            stats = await (await session.get("/api/stats")).json()
            if stats["queued"] + entered == len(inputs):
                break
        else:
            pytest.fail(f"the server never held every request: {stats}")
        async with asyncio.timeout(60):  # a hang guard only
            process.send_signal(signal.SIGTERM)
            await _log_line(process, "stopping: draining")
            process.send_signal(signal.SIGHUP)
            await _log_line(process, "SIGHUP ignored: the server is draining")
            process.send_signal(signal.SIGTERM)
            await _log_line(process, "SIGTERM: already draining")
            process.send_signal(signal.SIGINT)
            await _log_line(process, "SIGINT: already draining")
            assert not any(post.done() for post in posts)
            await asyncio.to_thread((tmp_path / "release").write_text, "g")
            while entered < len(inputs):  # the rest, in whatever batches they form
                entered += int(await asyncio.to_thread((tmp_path / "entered").read_text))
                await asyncio.to_thread((tmp_path / "release").write_text, "g")
            answers = await asyncio.gather(*posts)
            assert [answer.status for answer in answers] == [200] * len(inputs)
            outputs = [(await answer.json())["output"] for answer in answers]
            assert outputs == [text[::-1] for text in inputs]
            assert process.stderr is not None
            await process.stderr.read()
            assert await process.wait() == 0


def test_uds_refuses_a_path_that_is_not_a_socket_and_leaves_it(tmp_path):
    path = tmp_path / "bs.sock"
    path.write_text("precious")
    result = run_cli("--tcp", "off", "--uds", str(path), "--devices", "sim:1")
    assert result.returncode == 1
    assert result.stderr == (
        f"python -m batchserve: error: --uds {path}: something that is not a socket is there;"
        " remove it or choose another path\n"
    )
    assert path.read_text() == "precious"


def test_uds_refuses_a_socket_another_process_listens_on(tmp_path):
    path = str(tmp_path / "bs.sock")
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(path)
        other.listen()
        result = run_cli("--tcp", "off", "--uds", path, "--devices", "sim:1")
        assert result.returncode == 1
        assert result.stderr == (
            f"python -m batchserve: error: --uds {path}: another process is listening on it;"
            " stop it or choose another path\n"
        )
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)  # still the other process's
            accepted, _ = other.accept()
            accepted.close()


async def test_uds_replaces_a_stale_socket_and_removes_only_its_own(tmp_path):
    path = str(tmp_path / "bs.sock")
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(path)  # closed without removing the file: a crashed process's leftover
    async with real_server("--tcp", "off", "--uds", path, "--devices", "sim:1") as server:
        async with AsyncClient(uds=path) as client:
            assert (await client.infer("abc")).output == "cba"
        # Another process takes the path over while this one runs (say an operator removed
        # the file and started a second instance); this one's exit must leave it alone.
        with socket.socket(socket.AF_UNIX) as successor:
            os.unlink(path)
            successor.bind(path)
            theirs = os.stat(path).st_ino
            server.process.terminate()
            assert await server.process.wait() == 0
            assert os.stat(path).st_ino == theirs


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"timeout_ms": math.inf}, "timeout_ms must be more than 0 and at most 86400000"),
        ({"timeout_ms": math.nan}, "timeout_ms must be more than 0 and at most 86400000"),
        ({"timeout_ms": 1e300}, "timeout_ms must be more than 0 and at most 86400000"),
        ({"result_ttl_s": math.inf}, "result_ttl_s must be between 0 and 31536000"),
        ({"drain_timeout_s": math.inf}, "drain_timeout_s must be finite, not inf or nan"),
        ({"sim_cost": (1.0, math.inf)}, "sim_cost must be finite, not inf or nan"),
    ],
)
def test_settings_refuse_infinite_and_absurd_numbers(settings, message):
    with pytest.raises(StartupError) as refused:
        Config(**settings)
    assert str(refused.value) == message or str(refused.value).startswith(f"{message} ")
