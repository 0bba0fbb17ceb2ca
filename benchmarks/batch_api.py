"""The Batch API on idle capacity (issue #43): online latency with and without a batch, the
share of idle device time the batch used, and a batch that survives its server or replica.

`idle`: one simulated device shared by an online model (the simulated backend, a length cost
`--sim-cost 0.5,0.05`: a call's time grows with its batch, so online load leaves the device
idle between calls) and a simulated embedder of the same cost (`sim_embedder.py`). Capacity
is measured first (open-loop load at about 1.5x what the device can take: the answers a
second); then the same open-loop online load at 70 % of it runs twice on the same server,
alone and beside a 10,000-line `/v1/embeddings` batch created as its window starts (the
window order alternates between repeats). The server is pinned to core 0, loadgen.py to
core 1. Reported: the online p99 of both windows, and in the batch's window the device
seconds its lines used over the device time online calls left idle: the window less the
online calls' device time, and less the time the device stood free while online requests
waited for it (`batchserve_online_wait_seconds`: the batcher's pass between calls, a policy
lingering; lines never run then). The share over the window less the online calls alone
(what earlier runs reported) is printed beside it. The control: the same online waiting,
measured in the window without the batch (the server runs with `--count-online-wait on`), as
a share of the time online calls left there; if the batch lengthened it, the two shares
would part.

`restart`: `kill -9` of the server during a 2,000-line batch, a restart on the same
`--batch-db`, and the batch's completion. `replicas`: two replicas behind Debian's nginx
sharing redis-server (`deploy/replicas.py`), the one holding the batch's lease killed mid-
batch, the other finishing it. Each checks that the output holds every line once, each equal
to the same request sent online.

    flock /tmp/bench.lock python benchmarks/batch_api.py --repeats 3   # about 5 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from cpuinfo import describe
from progress import Progress
from servers import PORT, ROOT, run_loadgen, start_server, stop_server

sys.path.insert(0, str(ROOT))
from deploy.replicas import Replicas, free_ports, redis_server

SIM_COST = "0.5,0.05"
"""The online model's call: 0.5 ms plus 50 us per padded character (sim_embedder.COST_S)."""
MODELS = """
[[model]]
name = "online"
version = "1"
devices = "sim:1"
cost = "length"

[[model]]
name = "embed"
version = "1"
fn_per_device = "benchmarks.sim_embedder:load"
devices = "sim:1"
cost = "length"
max_batch_size = {line_batch}
"""
ONLINE = ("--models", "online:1")
"""loadgen.py's flag: every online request names the model `online`."""
OVERLOAD_RPS = 1100.0
"""Offered while capacity is measured: about 1.5x what the device takes (~740 a second)."""
CAPACITY_S = 6.0
LOAD_SHARE = 0.7
WAIT_S = 600.0
"""The longest any batch may take to finish, or a server to answer: a hang guard only."""


def doc(n: int) -> str:
    return f"document {n} " + "abcdefghij"[: n % 11]


def embedding_lines(count: int) -> list[dict[str, Any]]:
    return [
        {"custom_id": f"doc-{n}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "embed", "input": doc(n)}}
        for n in range(count)
    ]  # fmt: skip


def server_args(scratch: Path, *extra: str, line_batch: int = 8) -> list[str]:
    """The flags of every server here: the two models on one device, and `extra`."""
    models = scratch / "models.toml"
    models.write_text(MODELS.format(line_batch=line_batch))
    return ["--log-level", "WARNING", "--models", str(models), "--sim-cost", SIM_COST,
            "--count-online-wait", "on", *extra]  # fmt: skip


def server_command(scratch: Path, db: str, *extra: str, line_batch: int = 8) -> list[str]:
    return [sys.executable, "-m", "batchserve", "--port", str(PORT),
            *server_args(scratch, "--batch-db", db, *extra, line_batch=line_batch)]  # fmt: skip


async def create_batch(
    session: aiohttp.ClientSession, url: str, lines: list[dict[str, Any]]
) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    content = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    form.add_field("file", content, filename="lines.jsonl")
    async with session.post(f"{url}/v1/files", data=form) as answer:
        file = await answer.json()
    body = {"input_file_id": file["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
    async with session.post(f"{url}/v1/batches", json=body) as answer:
        batch = await answer.json()
    if batch.get("status") not in ("validating", "in_progress"):
        raise RuntimeError(f"the batch was not accepted: {batch}")
    return str(batch["id"])


async def get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as answer:
        return await answer.json()


async def until(
    session: aiohttp.ClientSession, url: str, batch_id: str, done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The batch once `done` holds of it, polled every 50 ms (any error: polled again)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, ValueError):
            batch: dict[str, Any] = await get(session, f"{url}/v1/batches/{batch_id}")
            if done(batch):
                return batch
        await asyncio.sleep(0.05)
    raise RuntimeError(f"batch {batch_id} did not get there in {WAIT_S:.0f} s")


def ended(batch: dict[str, Any]) -> bool:
    return batch["status"] in ("completed", "failed", "expired", "cancelled")


async def device_seconds(
    session: aiohttp.ClientSession, url: str
) -> tuple[float, float, float, int, int, float]:
    """(time, the devices' busy seconds, the batch lines' device seconds, lines done, the
    embedder's calls, seconds online requests waited for a free device), from /api/stats."""
    stats = await get(session, f"{url}/api/stats")
    busy = sum(device["busy_seconds"] for device in stats["devices"])
    [calls] = [model["batches"] for model in stats["models"] if model["model"] == "embed"]
    lines = stats["batch_api"]
    return (time.monotonic(), busy, lines["device_s"], lines["done"], calls,
            lines["online_wait_s"])  # fmt: skip


async def batch_window(rate: float, seconds: float, seed: int, lines: int) -> dict[str, Any]:
    """Online load beside a batch created as it starts; the batch's share of idle time."""
    url = f"http://127.0.0.1:{PORT}"
    async with aiohttp.ClientSession() as session:
        batch_id = await create_batch(session, url, embedding_lines(lines))
        start, busy0, lines0, done0, calls0, wait0 = await device_seconds(session, url)
        online = await asyncio.to_thread(run_loadgen, rate, seconds, seed, ONLINE)
        end, busy1, lines1, done1, calls1, wait1 = await device_seconds(session, url)
        running = (await get(session, f"{url}/v1/batches/{batch_id}"))["status"] == "in_progress"
        batch = await until(session, url, batch_id, ended)
    lines_s = lines1 - lines0
    left_s = (end - start) - (busy1 - busy0 - lines_s)  # one device
    idle_s = left_s - (wait1 - wait0)
    return {"online": online, "share": lines_s / idle_s, "share_of_left": lines_s / left_s,
            "online_wait_share": (wait1 - wait0) / left_s, "still_running": running,
            "completed": batch["request_counts"]["completed"],
            "per_call": (done1 - done0) / max(1, calls1 - calls0),
            "call_ms": 1e3 * lines_s / max(1, calls1 - calls0)}  # fmt: skip


async def alone_window(rate: float, seconds: float, seed: int) -> dict[str, Any]:
    """Online load alone; the control: how much of the time its calls left a free device
    was held for waiting online requests, with no batch on the server."""
    url = f"http://127.0.0.1:{PORT}"
    async with aiohttp.ClientSession() as session:
        start, busy0, _, _, _, wait0 = await device_seconds(session, url)
        online = await asyncio.to_thread(run_loadgen, rate, seconds, seed, ONLINE)
        end, busy1, _, _, _, wait1 = await device_seconds(session, url)
    left_s = (end - start) - (busy1 - busy0)
    return {"alone": online, "online_wait_share_alone": (wait1 - wait0) / left_s}


def idle_repeat(
    scratch: Path, seed: int, lines: int, seconds: float, line_batch: int, *flags: str
) -> dict[str, Any]:
    db = str(scratch / f"idle-{seed}.db")
    command = server_command(scratch, db, *flags, line_batch=line_batch)
    server = start_server(command, "batch_api.log")
    try:
        capacity = run_loadgen(OVERLOAD_RPS, CAPACITY_S, seed, ONLINE)["achieved_rps"]
        rate = LOAD_SHARE * capacity
        result: dict[str, Any] = {"capacity_rps": capacity, "rate": rate}
        for window in ("alone", "batch") if seed % 2 else ("batch", "alone"):
            window_run = alone_window(rate, seconds, seed) if window == "alone" else (
                batch_window(rate, seconds, seed, lines))  # fmt: skip
            result |= asyncio.run(window_run)
        return result
    finally:
        stop_server(server)


async def as_online(
    session: aiohttp.ClientSession, url: str, text: bytes, lines: list[dict[str, Any]]
) -> dict[str, Any]:
    """The output file against the lines: each once, each equal to its request sent online."""
    outputs = [orjson.loads(raw) for raw in text.splitlines()]
    ids = [output["custom_id"] for output in outputs]
    by_id = {line["custom_id"]: line for line in lines}
    gate = asyncio.Semaphore(64)

    async def same(output: dict[str, Any]) -> bool:
        async with (
            gate,
            session.post(f"{url}/v1/embeddings", json=by_id[output["custom_id"]]["body"]) as answer,
        ):
            online = await answer.json()
        body = output["response"]["body"]
        return answer.status == 200 and (body["data"], body["usage"]) == (
            online["data"],
            online["usage"],
        )

    equal = await asyncio.gather(*(same(o) for o in outputs if o["custom_id"] in by_id))
    return {"outputs": len(outputs), "each_once": len(set(ids)) == len(ids) == len(lines),
            "all_lines": set(ids) == set(by_id), "equal_online": sum(equal)}  # fmt: skip


async def finish_and_check(url: str, batch_id: str, lines: list[dict[str, Any]]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        batch = await until(session, url, batch_id, ended)
        result = {"status": batch["status"], "after_kill_s": time.monotonic() - started,
                  "counts": batch["request_counts"]}  # fmt: skip
        async with session.get(f"{url}/v1/files/{batch['output_file_id']}/content") as answer:
            text = await answer.read()
        return result | await as_online(session, url, text, lines)


async def start_and_kill_at(
    url: str, lines: list[dict[str, Any]], kill: Callable[[str], Awaitable[None]]
) -> tuple[str, int]:
    """Creates the batch; once a quarter of it is done, `kill(batch_id)`; (id, lines done)."""
    async with aiohttp.ClientSession() as session:
        batch_id = await create_batch(session, url, lines)
        batch = await until(
            session, url, batch_id, lambda b: b["request_counts"]["completed"] >= len(lines) // 4
        )
        await kill(batch_id)
    return batch_id, int(batch["request_counts"]["completed"])


def restart_check(scratch: Path, count: int) -> dict[str, Any]:
    db = str(scratch / "restart.db")
    command = server_command(scratch, db, "--batch-lines-in-flight", "16")
    lines, url = embedding_lines(count), f"http://127.0.0.1:{PORT}"
    server = start_server(command, "batch_api.log")

    async def kill(batch_id: str) -> None:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()

    try:
        batch_id, at_kill = asyncio.run(start_and_kill_at(url, lines, kill))
    finally:
        if server.poll() is None:
            stop_server(server)
    server = start_server(command, "batch_api.log")
    try:
        return {"done_at_kill": at_kill} | asyncio.run(finish_and_check(url, batch_id, lines))
    finally:
        stop_server(server)


def replicas_check(scratch: Path, count: int) -> dict[str, Any]:
    nginx_port, redis_port, *ports = free_ports(4)
    store = f"redis://127.0.0.1:{redis_port}/0"
    args = server_args(scratch, "--result-store", store, "--batch-lease-s", "2",
                       "--batch-lines-in-flight", "16")  # fmt: skip
    lines, url = embedding_lines(count), f"http://127.0.0.1:{nginx_port}"
    with redis_server(redis_port, scratch), Replicas(nginx_port, ports, args) as replicas:

        async def kill(batch_id: str) -> None:
            lease = f"batchserve:batches:lease:{batch_id}"
            cli = await asyncio.create_subprocess_exec(
                "redis-cli", "-p", str(redis_port), "GET", lease, stdout=subprocess.PIPE
            )
            holder = (await cli.communicate())[0].decode()
            pid = int(holder.split(":")[1])
            [index] = [i for i, r in enumerate(replicas.replicas) if r is not None and r.pid == pid]
            os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(replicas.replicas[index].wait)  # type: ignore[union-attr]
            replicas.replicas[index] = None

        batch_id, at_kill = asyncio.run(start_and_kill_at(url, lines, kill))
        return {"done_at_kill": at_kill} | asyncio.run(finish_and_check(url, batch_id, lines))


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="idle runs (seeds); medians")
    parser.add_argument("--seconds", type=float, default=15.0, help="each online window")
    parser.add_argument("--lines", type=int, default=10_000, help="the idle run's batch lines")
    parser.add_argument("--check-lines", type=int, default=2_000,
                        help="the restart and replicas runs' batch lines")  # fmt: skip
    parser.add_argument(
        "--line-batch",
        type=int,
        default=8,
        help="the embedder's batch limit (a line call holds at most this)",
    )
    parser.add_argument(
        "--idle-call-ms",
        type=float,
        default=None,
        help="the server's --idle-call-ms (default: the server's default)",
    )
    parser.add_argument("--only", choices=("idle", "restart", "replicas"), default=None,
                        help="run only this part")  # fmt: skip
    args = parser.parse_args()
    if min(args.repeats, args.lines, args.line_batch) < 1 or args.seconds <= 2:
        parser.error("--repeats, --lines and --line-batch must be 1 or more, --seconds over 2")
    if args.check_lines < 4:
        parser.error("--check-lines must be 4 or more")
    parts = [args.only] if args.only else ["idle", "restart", "replicas"]
    if "replicas" in parts and not (shutil.which("nginx") and shutil.which("redis-server")):
        parser.error("the replicas part needs Debian's nginx and redis-server (apt-get install)")
    os.chdir(ROOT)
    print(describe(), flush=True)
    progress = Progress(args.repeats * ("idle" in parts) + len(parts) - ("idle" in parts))
    with tempfile.TemporaryDirectory(prefix="batchserve-batch-bench-") as folder:
        scratch = Path(folder)
        if "idle" in parts:
            flags = [] if args.idle_call_ms is None else ["--idle-call-ms", str(args.idle_call_ms)]
            runs = []
            for seed in range(1, args.repeats + 1):
                runs.append(idle_repeat(scratch, seed, args.lines, args.seconds, args.line_batch,
                                        *flags))  # fmt: skip
                run = runs[-1]
                progress.step(
                    f"idle seed {seed}: capacity {run['capacity_rps']:.0f} rps, p99 alone"
                    f" {run['alone']['p99_ms']:.1f} ms, with the batch"
                    f" {run['online']['p99_ms']:.1f} ms"
                    f" ({run['online']['p99_ms'] / run['alone']['p99_ms']:.2f}x), idle share"
                    f" {run['share']:.1%} (of all the online calls left {run['share_of_left']:.1%};"
                    f" online waiting {run['online_wait_share']:.1%} of it, alone"
                    f" {run['online_wait_share_alone']:.1%}),"
                    f" {run['per_call']:.2f} lines a call of {run['call_ms']:.2f} ms"
                )
            alone = median([r["alone"]["p99_ms"] for r in runs])
            beside = median([r["online"]["p99_ms"] for r in runs])
            print(f"| capacity (rps) | offered (rps) | p99 alone (ms) | p99 with the batch (ms) |"
                  f" ratio | idle device time the batch used | online waiting, of the time"
                  f" online calls left: alone / with the batch | lines a call | ms a line call |"
                  f" batch still running at the window's end | lines completed |\n"
                  f"|---|---|---|---|---|---|---|---|---|---|---|\n"
                  f"| {median([r['capacity_rps'] for r in runs]):.0f} |"
                  f" {median([r['rate'] for r in runs]):.0f} | {alone:.1f} | {beside:.1f} |"
                  f" {median([r['online']['p99_ms'] / r['alone']['p99_ms'] for r in runs]):.2f}x |"
                  f" {median([r['share'] for r in runs]):.1%}"
                  f" ({median([r['share_of_left'] for r in runs]):.1%} of all the calls left) |"
                  f" {median([r['online_wait_share_alone'] for r in runs]):.1%} /"
                  f" {median([r['online_wait_share'] for r in runs]):.1%} |"
                  f" {median([r['per_call'] for r in runs]):.2f} |"
                  f" {median([r['call_ms'] for r in runs]):.2f} |"
                  f" {sum(r['still_running'] for r in runs)} of {len(runs)} |"
                  f" {min(r['completed'] for r in runs)} |",
                  flush=True)  # fmt: skip
            for run in runs:
                print(f"  success alone {run['alone']['success']:.2%}, with the batch"
                      f" {run['online']['success']:.2%}", flush=True)  # fmt: skip
        for part, check in (("restart", restart_check), ("replicas", replicas_check)):
            if part in parts:
                result = check(scratch, args.check_lines)
                progress.step(part)
                print(f"{part}: {result}", flush=True)


if __name__ == "__main__":
    main()
