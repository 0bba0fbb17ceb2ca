"""The command line, and the real `python -m batchserve` process as a user runs it."""

from __future__ import annotations

import asyncio
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
from batchserve.config import Config
from batchserve.engine import Engine
from batchserve.errors import NotReady

from .conftest import ROOT, real_server


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
    assert text.count("on or off;") == 5  # each switch names the values it takes
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
        (["--fn", "tests.sample_models:nope"], "has no attribute nope"),
        (
            ["--fn-per-device", "tests.sample_models:broken"],
            "device sim:0 failed to load: RuntimeError: no weights found",
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
        assert await asyncio.wait_for(process.wait(), 30) == 0


async def test_real_process_exits_on_sigterm_while_a_device_is_hung():
    """A wedged call's thread cannot be killed; it must not keep the process alive."""
    async with real_server(
        "--devices", "sim:2", "--sim-latency-ms", "1", "--sim-hang-ms", "600000",
        "--batch-timeout-ms", "200",
    ) as (process, _, url):  # fmt: skip
        async with aiohttp.ClientSession(url) as session:
            answer = await session.post("/api/inference", json={"input": "x!hang!"})
            assert (await answer.json())["output"] == "!gnah!x"  # retried on the other device
            devices = (await (await session.get("/readyz")).json())["devices"]
            assert sorted(devices.values()) == ["hung", "idle"]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
