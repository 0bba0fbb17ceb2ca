"""Generation: continuous batching against static batching, and the tiny torch model against
itself stepped directly.

Each point starts `python -m batchserve --generator ...` pinned to core 0; this script sends
the load from core 1. Open loop: requests leave at Poisson times, each a streamed
`/api/generate`, and time to first token counts from the scheduled send time. Tokens/s counts
the tokens that arrived inside the measured window (after the warm-up), so a mode that falls
behind shows what it delivers, not what it was sent. Medians over repeats.

    python benchmarks/generation.py modes --repeats 3 --seconds 20   # sim: continuous vs static
    python benchmarks/generation.py tiny --repeats 3 --seconds 10    # tiny_gpt on cpu vs direct

The mix: 90 % short requests (about 10 tokens), 10 % long (about 300); the simulated
generator answers a prompt with the prompt reversed, so a prompt's length is its output's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

import aiohttp
from cpuinfo import describe
from servers import ROOT, start_server, stop_server

PORT = 8766
SIM = ("--generator", "sim", "--devices", "sim:1", "--sim-step-ms", "10,0.05")


def serve(*args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "batchserve", "--port", str(PORT), "--log-level",
               "WARNING", "--max-queue", "100000", *args]  # fmt: skip
    return start_server(command, "generation-server.log")


def prompt_for(rng: random.Random) -> str:
    size = max(1, round(rng.gauss(300, 30))) if rng.random() < 0.1 else rng.randint(6, 14)
    return "".join(rng.choice("abcdefghij") for _ in range(size))


async def open_loop(rate: float, seconds: float, warmup_s: float, seed: int) -> dict[str, float]:
    """Streams at `rate` a second for `seconds`; numbers from after `warmup_s`."""
    rng = random.Random(seed)
    url = f"http://127.0.0.1:{PORT}/api/generate"
    ttfts: list[float] = []
    arrivals: list[float] = []
    statuses: list[int] = []
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.2
    window = (start + warmup_s, start + seconds)

    async def one(session: aiohttp.ClientSession, send_at: float, prompt: str) -> None:
        await asyncio.sleep(max(0.0, send_at - loop.time()))
        measured = window[0] <= send_at < window[1]
        body = {"prompt": prompt, "max_tokens": 400, "stream": True}
        async with session.post(url, json=body) as response:
            if measured:
                statuses.append(response.status)
            if response.status != 200:
                return
            first = True
            async for line in response.content:
                if not line.startswith(b'data: {"token"'):
                    continue
                now = loop.time()
                if first and measured:
                    ttfts.append(now - send_at)
                first = False
                arrivals.append(now)

    send_at, tasks = start, []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        while send_at < start + seconds:
            tasks.append(asyncio.ensure_future(one(session, send_at, prompt_for(rng))))
            send_at += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, window[1] - loop.time()))
        _done, pending = await asyncio.wait(tasks, timeout=30)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    ok = [s for s in statuses if s == 200]
    in_window = sum(window[0] <= t < window[1] for t in arrivals)
    ordered = sorted(ttfts)
    return {
        "tokens_per_s": in_window / (window[1] - window[0]),
        "sent": len(statuses),
        "ok": len(ok) / max(1, len(statuses)),
        "ttft_p50_ms": 1e3 * ordered[len(ordered) // 2] if ordered else float("nan"),
        "ttft_p99_ms": 1e3 * ordered[int(len(ordered) * 0.99)] if ordered else float("nan"),
    }


def modes(rates: list[float], seconds: float, repeats: int) -> None:
    rows = []
    for rate in rates:
        for mode in ("continuous", "static"):
            runs = []
            for seed in range(repeats):
                server = serve(*SIM, "--generate-mode", mode)
                try:
                    runs.append(asyncio.run(open_loop(rate, seconds, seconds / 4, seed)))
                finally:
                    stop_server(server)
                print(f"  {mode} {rate:g}/s seed {seed}: {runs[-1]}", file=sys.stderr)
            rows.append((rate, mode, {k: statistics.median(r[k] for r in runs) for k in runs[0]}))
    print("| offered (req/s) | mode | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | answered 200 |")
    print("|---|---|---|---|---|---|")
    for rate, mode, m in rows:
        print(
            f"| {rate:g} | {mode} | {m['tokens_per_s']:.0f} | {m['ttft_p50_ms']:.0f}"
            f" | {m['ttft_p99_ms']:.0f} | {m['ok']:.1%} |"
        )


def direct_rate(batch: int, tokens: int, seconds: float) -> float:
    """tiny_gpt stepped in a loop on this process's core, `batch` sequences at a time."""
    from batchserve.models.generators import Seq
    from batchserve.models.tiny_gpt import load

    model = load("cpu")
    made, began, round_ = 0, time.perf_counter(), 0
    while time.perf_counter() - began < seconds:
        seqs = [Seq(f"{round_}-{i}", prompt_of(i)) for i in range(batch)]
        for _ in range(tokens):
            for seq, token in zip(seqs, model.step(seqs), strict=True):
                seq.tokens.append(token or " ")
        model.release([seq.id for seq in seqs])
        made += batch * tokens
        round_ += 1
    return made / (time.perf_counter() - began)


def prompt_of(index: int) -> str:
    return f"tiny prompt {index:03d} " * 2


async def closed_loop(batch: int, tokens: int, seconds: float) -> float:
    """`batch` clients, each sending its next generation when the last one ends."""
    url = f"http://127.0.0.1:{PORT}/api/generate"
    made = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        nonlocal made
        while loop.time() < end:
            body = {"prompt": prompt_of(index), "max_tokens": tokens}
            async with session.post(url, json=body) as response:
                made += (await response.json())["tokens"]

    began = loop.time()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session, i) for i in range(batch)))
    return made / (loop.time() - began)


def tiny(seconds: float, repeats: int, batch: int, tokens: int) -> None:
    ratios, served, direct = [], [], []
    for _ in range(repeats):
        run = subprocess.run(
            ["taskset", "-c", "0", sys.executable, __file__, "direct", "--batch", str(batch),
             "--tokens", str(tokens), "--seconds", str(seconds)],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        direct.append(float(run.stdout))
        server = serve(
            "--generator", "batchserve.models.tiny_gpt:load", "--devices", "cpu",
            "--max-tokens-cap", str(tokens),
        )  # fmt: skip
        try:
            served.append(asyncio.run(closed_loop(batch, tokens, seconds)))
        finally:
            stop_server(server)
        ratios.append(served[-1] / direct[-1])
        print(f"  direct {direct[-1]:.0f} tok/s, served {served[-1]:.0f}", file=sys.stderr)
    print(
        "| batch | tokens | direct tok/s | served tok/s | served / direct |\n|---|---|---|---|---|"
    )
    print(
        f"| {batch} | {tokens} | {statistics.median(direct):.0f} | {statistics.median(served):.0f}"
        f" | {statistics.median(ratios):.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modes_parser = sub.add_parser("modes", help="continuous vs static on the sim generator")
    modes_parser.add_argument("--rates", default="20,40,80", help="offered requests/s, a,b,c")
    tiny_parser = sub.add_parser("tiny", help="tiny_gpt on cpu: served vs stepped directly")
    direct_parser = sub.add_parser("direct", help=argparse.SUPPRESS)
    for each in (modes_parser, tiny_parser, direct_parser):
        each.add_argument("--seconds", type=float, default=20, help="each point's duration")
        each.add_argument("--repeats", type=int, default=3, help="runs per point (median)")
    for each in (tiny_parser, direct_parser):
        each.add_argument("--batch", type=int, default=16, help="sequences at once")
        each.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    args = parser.parse_args()
    if args.command == "direct":
        print(direct_rate(args.batch, args.tokens, args.seconds))
        return
    print(describe())
    os.sched_setaffinity(0, {1})
    if args.command == "modes":
        modes([float(r) for r in args.rates.split(",")], args.seconds, args.repeats)
    else:
        tiny(args.seconds, args.repeats, args.batch, args.tokens)


if __name__ == "__main__":
    main()
