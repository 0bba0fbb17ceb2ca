"""--config FILE and SIGHUP: the file's settings under the environment's and the flags', a
reload under load that drops no request, a bad file refused whole, and restart-only settings
named and kept."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from batchserve.cli import config_from_args
from batchserve.config import Config
from batchserve.errors import StartupError
from batchserve.live_config import live_changes, model_changes
from batchserve.models.specs import ModelSpec

from .conftest import ROOT


def test_the_file_gives_defaults_that_the_environment_and_flags_override(tmp_path, monkeypatch):
    settings = tmp_path / "batchserve.toml"
    settings.write_text(
        "max-batch-size = 32\nmax_linger_ms = 7.5\nmax-queue = 50\nmetrics = false\n"
        'log-level = "WARNING"\nuds-mode = "660"\n'
    )
    monkeypatch.setenv("BATCHSERVE_MAX_QUEUE", "60")
    config, log_level = config_from_args(["--config", str(settings), "--max-batch-size", "8"])
    assert (config.max_batch_size, config.max_linger_ms, config.max_queue) == (8, 7.5, 60)
    assert (config.metrics, config.uds_mode, log_level) == (False, 0o660, "WARNING")


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("max-batch = 3\n", "no such setting: max_batch"),
        ('max-batch-size = "many"\n', "max-batch-size"),
        ("max-batch-size = 1000\n", "max_batch_size must be between 1 and 100"),
        ("max-batch-size = [\n", "not valid TOML"),
        ('log-level = "LOUD"\n', "log_level must be one of"),
    ],
)
def test_a_bad_file_is_refused_with_one_line_naming_the_fault(tmp_path, text, named):
    settings = tmp_path / "batchserve.toml"
    settings.write_text(text)
    with pytest.raises(StartupError, match=named):
        config_from_args(["--config", str(settings)])


def test_restart_only_settings_are_named_and_keep_their_running_values():
    running = Config(port=8000, devices="sim:2", max_batch_size=50)
    changes = live_changes(running, Config(port=9000, devices="sim:4", max_batch_size=10))
    assert changes.changed == ["max_batch_size"]
    assert changes.kept == ["port", "devices"]
    assert (changes.config.port, changes.config.devices, changes.config.max_batch_size) == (
        8000, "sim:2", 10,
    )  # fmt: skip


def test_model_changes_add_remove_reweigh_retune_and_keep_the_rest():
    a1 = ModelSpec(name="a", version="1", fn="m:f", weight=1.0)
    a2 = ModelSpec(name="a", version="2", fn="m:f")
    b1 = ModelSpec(name="b", version="1", fn="m:g")
    wanted = [
        ModelSpec(name="a", version="1", fn="m:f", weight=3.0, max_batch_size=8),
        ModelSpec(name="b", version="1", fn="m:other"),
        ModelSpec(name="c", version="1", fn="m:h"),
    ]
    changes = model_changes([a1, a2, b1], wanted)
    assert [s.label for s in changes.add] == ["c@1"]
    assert changes.remove == [("a", "2")]
    assert [s.label for s in changes.reweigh] == ["a@1"]
    assert [s.label for s in changes.retune] == ["a@1"]
    assert changes.kept == ["b@1"]


CONCURRENCY = 8


async def steady_load(url: str, stop: asyncio.Event, statuses: Counter[int]) -> int:
    """Requests until `stop`; counts statuses; returns the wrong outputs."""
    wrong = 0

    async def worker(session: aiohttp.ClientSession, n: int) -> None:
        nonlocal wrong
        sent = 0
        while not stop.is_set() and sent < 5000:
            sent += 1
            text = f"w{n}-{sent}"
            async with session.post(f"{url}/api/inference", json={"input": text}) as answer:
                statuses[answer.status] += 1
                if answer.status == 200 and (await answer.json())["output"] != text[::-1]:
                    wrong += 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session, n) for n in range(CONCURRENCY)))
    return wrong


async def batch_limit(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/api/models") as answer:
        (model,) = (await answer.json())["models"]
    return int(model["versions"][0]["max_batch_size"])


async def wait_for_limit(session: aiohttp.ClientSession, url: str, limit: int) -> None:
    for _ in range(100_000):  # the signal is handled on the server's own loop
        if await batch_limit(session, url) == limit:
            return
    pytest.fail(f"the batch limit never became {limit}")


async def logged(stderr: asyncio.StreamReader, seen: list[str], words: str) -> None:
    """Reads the server's stderr into `seen` until a line has `words` (signals that arrive
    together are handled once, so each reload is awaited before the next)."""
    while line := (await stderr.readline()).decode():
        seen.append(line)
        if words in line:
            return
    pytest.fail(f"the server exited without logging {words!r}")


async def test_a_reload_under_load_applies_live_settings_and_drops_no_request(tmp_path: Path):
    settings = tmp_path / "batchserve.toml"
    settings.write_text("max-batch-size = 16\nmax-linger-ms = 5\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "batchserve", "--port", "0", "--config", str(settings),
        "--devices", "sim:2", "--sim-latency-ms", "20",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    seen: list[str] = []
    try:
        assert process.stdout is not None
        assert process.stderr is not None
        url = (await process.stdout.readline()).decode().split()[3]
        statuses: Counter[int] = Counter()
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(url, stop, statuses))
        async with aiohttp.ClientSession() as session:
            assert await batch_limit(session, url) == 16
            settings.write_text("max-batch-size = 4\nmax-linger-ms = 5\nmetrics = false\n")
            process.send_signal(signal.SIGHUP)
            await wait_for_limit(session, url, 4)
            settings.write_text("max-batch-size = 400\n")  # over the backend's limit
            process.send_signal(signal.SIGHUP)
            await logged(process.stderr, seen, "reload refused")
            assert await batch_limit(session, url) == 4
            settings.write_text("max-batch-size = 3\n")
            process.send_signal(signal.SIGHUP)
            await wait_for_limit(session, url, 3)
        stop.set()
        wrong = await load
        process.send_signal(signal.SIGTERM)
        seen.append((await process.stderr.read()).decode())
        assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    log = "".join(seen)
    assert "reload: these apply only after a restart and keep their running values: metrics" in log
    assert "reload refused, the running settings stay: max_batch_size must be between 1" in log
    assert list(statuses) == [200]
    assert wrong == 0
