"""Three replicas behind Debian's real nginx (deploy/nginx/batchserve.conf, started by
`deploy/replicas.py`): one replica is stopped with SIGTERM under steady load and started
again, and no client sees it. Skipped where nginx is not installed (CI installs it)."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections import Counter

import aiohttp
import pytest

from deploy.replicas import NGINX_CONF, Replicas, free_ports, nginx_site

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")

CONCURRENCY = 12
MAX_REQUESTS = 20_000
"""A bound on the load whatever happens: each phase ends on an event, well before this."""


def test_the_site_file_gets_one_upstream_line_per_replica() -> None:
    site = nginx_site(NGINX_CONF.read_text(), [9001, 9002], 9000)
    assert re.findall(r"server 127\.0\.0\.1:(\d+) max_fails", site) == ["9001", "9002"]
    assert "listen 127.0.0.1:9000;" in site
    assert "proxy_next_upstream error timeout non_idempotent;" in site
    assert "http_503" not in site.split("proxy_next_upstream ")[1].split(";")[0]


class Load:
    """Steady requests through nginx, each with its own input, checked against its answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.statuses: Counter[int] = Counter()
        self.wrong = 0
        self.sent = 0
        self.failures: list[str] = []
        """What each answer other than 200 said, for the failure message."""
        self.stop = asyncio.Event()
        self.progress = asyncio.Event()
        """Set at each answer, and when a worker ends."""

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._worker(session, n) for n in range(CONCURRENCY)))

    async def _worker(self, session: aiohttp.ClientSession, worker: int) -> None:
        while not self.stop.is_set() and self.sent < MAX_REQUESTS:
            self.sent += 1
            text = f"w{worker}-n{self.sent}"
            async with session.post(f"{self.url}/api/inference", json={"input": text}) as answer:
                self.statuses[answer.status] += 1
                if answer.status != 200:
                    self.failures.append(f"{answer.status} {answer.headers} {await answer.text()}")
                elif (await answer.json())["output"] != text[::-1]:
                    self.wrong += 1
            self.progress.set()
        self.progress.set()

    async def until_answered(self, count: int) -> None:
        target = self.statuses[200] + count
        while self.statuses[200] < target and self.sent < MAX_REQUESTS:
            self.progress.clear()
            await self.progress.wait()


async def answered_by(session: aiohttp.ClientSession, port: int) -> float:
    """The 200s a replica has answered, from its own /metrics."""
    async with session.get(f"http://127.0.0.1:{port}/metrics") as answer:
        text = await answer.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("batchserve_requests_total{")
        and 'code="200"' in line
        and 'route="inference"' in line
    )


async def test_a_replica_stopped_and_restarted_under_load_costs_no_request() -> None:
    nginx_port, *replica_ports = free_ports(4)
    replicas = Replicas(nginx_port, replica_ports, ["--devices", "sim:2", "--sim-latency-ms", "20"])
    await asyncio.to_thread(replicas.start)
    try:
        load = Load(f"http://127.0.0.1:{nginx_port}")
        started = time.monotonic()
        running = asyncio.create_task(load.run())
        try:
            await load.until_answered(300)
            async with aiohttp.ClientSession() as session:
                # Over nginx's 16 KB buffer, a body goes through its temp folder: a Batch
                # API upload of a few hundred lines.
                text = "x" * 100_000
                big = await session.post(load.url + "/api/inference", json={"input": text})
                assert (big.status, (await big.json())["output"]) == (200, text)
            exit_status = await asyncio.to_thread(replicas.stop_replica, 1)
            await load.until_answered(300)
            await asyncio.to_thread(replicas.start_replica, 1)
            async with aiohttp.ClientSession() as session:
                while await answered_by(session, replica_ports[1]) < 50:
                    assert load.sent < MAX_REQUESTS, "the restarted replica got no traffic"
                    await load.until_answered(50)
        finally:
            load.stop.set()
            await running
        seconds = time.monotonic() - started
    finally:
        await asyncio.to_thread(replicas.close)
    print(f"\nnginx + 3 replicas: {sum(load.statuses.values())} requests in {seconds:.1f} s,"
          f" statuses {dict(load.statuses)}, wrong outputs {load.wrong}")  # fmt: skip
    assert exit_status == 0
    assert load.statuses == Counter({200: load.sent}), load.failures
    assert load.wrong == 0
