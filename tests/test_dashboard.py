"""The dashboard in a real browser: Debian's headless Chromium, which .ci/run installs."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest

from batchserve import Caller
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.models.backends import simulated_factory
from batchserve.rules.tenants import Tenant
from batchserve.server import create_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)"
)


async def chromium(profile: Path, *args: str) -> str:
    """Runs headless Chromium to the end of its virtual-time budget; returns its stdout."""
    assert CHROMIUM is not None
    process = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        f"--user-data-dir={profile}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    stdout, _ = await asyncio.wait_for(process.communicate(), 120)  # a hang guard only
    assert process.returncode == 0
    return stdout.decode()


async def test_the_page_loads_and_its_charts_follow_the_load(start_server, tmp_path):
    client, engine = await start_server(simulated_factory(0.005, 100), devices=2)
    url = str(client.make_url("/"))
    line = Caller(tenant=Tenant("batch-owner", "free", idle=True))
    await asyncio.gather(*(engine.infer(f"line-{n}", line) for n in range(3)))
    loading = asyncio.Event()
    stop = asyncio.Event()

    async def load() -> None:
        for _ in range(2000):  # bounded: at most 40,000 requests
            await asyncio.gather(
                *(client.post("/api/inference", json={"input": "x"}) for _ in range(20))
            )
            loading.set()
            if stop.is_set():
                return

    loader = asyncio.create_task(load())
    try:
        await loading.wait()
        dom = await chromium(tmp_path / "a", "--dump-dom", "--virtual-time-budget=5000", url)
        screenshot = tmp_path / "dashboard.png"
        await chromium(
            tmp_path / "b", f"--screenshot={screenshot}", "--window-size=1200,900",
            "--virtual-time-budget=3000", url,
        )  # fmt: skip
    finally:
        stop.set()
        await loader
    body = re.search(r"<body([^>]*)>", dom)
    assert body is not None
    attributes = dict(re.findall(r'data-([a-z]+)="([^"]*)"', body.group(1)))
    assert "error" not in attributes
    assert int(attributes["updates"]) >= 3  # polled again and again while the load ran
    assert int(attributes["points"]) >= 3
    assert float(attributes["throughput"]) > 0
    assert dom.count("<canvas") >= 4  # the four uPlot charts drew
    assert 'data-model="default@1"' in dom  # the per-model table has its row
    assert "<td>sim:0</td>" in dom
    assert "<td>sim:1</td>" in dom
    assert '<b id="batch_done">3</b>' in dom  # the Batch API's lines, and their share
    share = re.search(r'<b id="batch_share">([^<]*)</b>', dom)
    assert share is not None
    assert float(share.group(1)) >= 0
    assert screenshot.read_bytes().startswith(b"\x89PNG")


async def test_a_generation_server_shows_its_models_row(aiohttp_client, tmp_path):
    engine = Engine(Config(generator="sim", devices="sim:1", sim_step_ms=(1, 0)))
    client = await aiohttp_client(create_app(engine))
    answer = await client.post("/api/generate", json={"prompt": "shown"})
    assert (await answer.json())["output"] == "nwohs"
    dom = await chromium(
        tmp_path / "a", "--dump-dom", "--virtual-time-budget=3000", str(client.make_url("/"))
    )
    body = re.search(r"<body([^>]*)>", dom)
    assert body is not None
    assert "data-error" not in body.group(1)
    generation = re.search(r'<tbody id="generation">(.*?)</tbody>', dom, re.S)
    assert generation is not None
    assert 'data-model="default@1"' in generation.group(1)
    assert "<td>sim:0</td>" in generation.group(1)
