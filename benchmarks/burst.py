"""A burst of chats sharing a system prompt, on our server alone, under two sets of flags.

`vllm_peer.py`'s shared-prefix workload without the peer: 16 chats at once over one new
~1,000-token system prompt (cold), then 16 new turns over the same prompt (warm), 48 tokens
out each, SmolLM2's folder; our server launched as `vllm_peer.py` launches it in `--setup`,
once for each set of flags, the sets alternated `--rounds` times. Prints the time to the first
token (p50, p99: the burst's last chat) and tokens/s of each burst, and the medians.

    python benchmarks/burst.py --a "--prefill-step-tokens 256" --b "" --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import vllm_peer as peer


def bursts(flags: str, setup: str, repeats: int, seed: int) -> dict[str, list[dict]]:
    """One server with `flags`; `repeats` pairs of cold and warm bursts, each on a new prompt."""
    server = peer.launch("batchserve", setup, flags.split())
    rows: dict[str, list[dict]] = {"cold": [], "warm": []}
    try:
        asyncio.run(peer.streams(peer.PORTS["batchserve"], 2, 6))  # first-call costs out
        for repeat in range(repeats):
            system = peer.system_prompt(seed + repeat, 1000)
            for phase, turn_seed in peer.PHASES.items():
                peer.quiet({"batchserve": server})
                row = asyncio.run(
                    peer.shared_prefix(peer.PORTS["batchserve"], system, turn_seed, 1)
                )
                rows[phase].append(row)
                print(f"  [{flags or 'defaults'}] {phase}: TTFT p50 {row['ttft_p50_ms']:.0f}"
                      f" p99 {row['ttft_p99_ms']:.0f} ms, {row['tokens_per_s']:.1f} tokens/s",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        peer.stop(server)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", default="", help="flags of the first server (quoted)")
    parser.add_argument("--b", default="", help="flags of the second server (quoted)")
    parser.add_argument(
        "--setup",
        choices=("recommended", "same-threads"),
        default="recommended",
        help="recommended: defaults on every core; same-threads: fp32, one thread, core 0",
    )
    parser.add_argument("--rounds", type=int, default=2, help="times each set is launched")
    parser.add_argument("--repeats", type=int, default=2, help="cold+warm bursts a launch")
    args = parser.parse_args()
    same = args.setup == "same-threads"  # the server on core 0, this client on core 1
    os.sched_setaffinity(0, {1} if same else set(range(os.cpu_count() or 1)))
    print(f"setup {args.setup}; {peer.describe()}", flush=True)
    results: dict[str, dict[str, list[dict]]] = {args.a: {}, args.b: {}}
    seed = int(time.time()) % 100_000  # prompts no earlier run cached
    for round_ in range(args.rounds):
        for flags in (args.a, args.b):
            seed += args.repeats
            for phase, rows in bursts(flags, args.setup, args.repeats, seed).items():
                results[flags].setdefault(phase, []).extend(rows)
        print(f"  round {round_} done", file=sys.stderr, flush=True)
    print("\n| flags | burst | TTFT p50 ms | TTFT p99 ms | tokens/s |\n|---|---|---|---|---|")
    for flags, phases in results.items():
        for phase, rows in phases.items():
            cells = [statistics.median(row[key] for row in rows)
                     for key in ("ttft_p50_ms", "ttft_p99_ms", "tokens_per_s")]  # fmt: skip
            print(f"| `{flags or 'defaults'}` | {phase} | {cells[0]:,.0f} | {cells[1]:,.0f} |"
                  f" {cells[2]:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
