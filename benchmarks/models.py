"""Several models on shared devices, and cost-aware batching, measured end to end.

Each point starts `python -m batchserve` on core 0 and the open-loop load generator on
core 1 (sweep.run_point), medians over repeats.

    python benchmarks/models.py shared --repeats 3     # two models 95 % / 5 %, and a flood
    python benchmarks/models.py length --repeats 3     # --sim-cost, flat vs cost-aware
    python benchmarks/models.py minilm --repeats 3     # MiniLM on cpu vs called directly
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loadgen import plain_input
from sweep import ROOT, Setup, run_point

SHARED = """
[[model]]
name = "hot"
version = "1"
fn_per_device = "benchmarks.keyed_sim:hot"
devices = "{devices}"
max_batch_size = {hot_batch}

[[model]]
name = "cold"
version = "1"
fn_per_device = "benchmarks.keyed_sim:cold"
devices = "{devices}"
"""

LENGTH = """
[[model]]
name = "m"
version = "1"
devices = "sim:2"
cost = "{cost}"
"""
SIM_COST = "5,0.002"
"""5 ms a call plus 2 us per padded token (batch size x longest input, in characters)."""


def models_setup(scratch: Path, name: str, text: str, *extra: str) -> Setup:
    path = scratch / f"{name}.toml"
    path.write_text(text)
    return Setup(name, ("--models", str(path), *extra), devices=0)


def point(setup: Setup, rate: float, seconds: float, repeats: int, *load: str) -> list[dict]:
    runs = []
    for seed in range(1, repeats + 1):
        runs.append(run_point(setup, rate, seconds, seed, load))
        result = runs[-1]
        print(f"  {setup.name} {rate:g} rps seed {seed}: success {result['success']:.2%},"
              f" p99 {result['p99_ms']:.0f} ms, by class "
              + ", ".join(f"{k} p99 {v['p99_ms']:.0f}" for k, v in result["by_key"].items()),
              flush=True)  # fmt: skip
    return runs


def med(runs: list[dict], *path: str) -> float:
    values = []
    for run in runs:
        value: object = run
        for key in path:
            value = value[key]  # type: ignore[index]
        values.append(float(value))  # type: ignore[arg-type]
    return statistics.median(values)


def cell(runs: list[dict], *path: str) -> str:
    """ "p50 / p99" in ms, of the whole run or of one class (`by_key`, name)."""
    return f"{med(runs, *path, 'p50_ms'):.0f} / {med(runs, *path, 'p99_ms'):.0f}"


def shared(scratch: Path, seconds: float, repeats: int) -> None:
    four = models_setup(scratch, "shared-sim4", SHARED.format(devices="sim:4", hot_batch=100))
    alone = point(four, 140, seconds, repeats, "--models", "cold:1")
    hot_alone = point(four, 2660, seconds, repeats, "--models", "hot:1")
    mixed = point(four, 2800, seconds, repeats, "--models", "hot:95,cold:5")
    print("\n| sim:4 shared, 100 ms calls | cold p50 / p99 ms | hot p50 / p99 ms | success |")
    print("|---|---|---|---|")
    print(f"| cold alone, 140 rps | {cell(alone)} | - | {med(alone, 'success'):.2%} |")
    print(f"| hot alone, 2,660 rps | - | {cell(hot_alone)} | {med(hot_alone, 'success'):.2%} |")
    print(f"| 95 % hot / 5 % cold, 2,800 rps (70 %) | {cell(mixed, 'by_key', 'cold')} |"
          f" {cell(mixed, 'by_key', 'hot')} | {med(mixed, 'success'):.2%} |")  # fmt: skip
    # The flood: hot batches of at most 10 on one device (100 rps of capacity) at 150 rps.
    # Small batches keep the HTTP work far from the core's limit, so what shows is the
    # scheduling. Requests past their deadline free their connections within 1 s (not the
    # default 5 s), so the backlog stays in the server, not in the load generator's
    # connection pool, where cold requests would queue behind hot ones.
    one = models_setup(
        scratch, "shared-sim1", SHARED.format(devices="sim:1", hot_batch=10),
        "--timeout-ms", "1000",
    )  # fmt: skip
    quiet = point(one, 5, max(seconds, 20), repeats, "--models", "cold:1")
    flood = point(one, 155, max(seconds, 20), repeats, "--models", "hot:150,cold:5")
    print("\n| sim:1 shared, 100 ms calls, hot batches <= 10 | cold p50 / p99 ms | hot 200s |")
    print("|---|---|---|")
    print(f"| cold alone, 5 rps | {cell(quiet)} | - |")
    print(f"| hot flooded at 150 % + cold 5 rps | {cell(flood, 'by_key', 'cold')} |"
          f" {med(flood, 'by_key', 'hot', 'success'):.0%} |")  # fmt: skip


def length(scratch: Path, seconds: float, repeats: int, rates: list[float]) -> None:
    print("| cost | rate | success | p99 ms | short p50 ms | long p99 ms | mean batch |")
    print("|---|---|---|---|---|---|---|")
    for cost in ("flat", "length"):
        setup = models_setup(scratch, f"length-{cost}", LENGTH.format(cost=cost),
                             "--sim-cost", SIM_COST)  # fmt: skip
        for rate in rates:
            runs = point(setup, rate, seconds, repeats, "--length-mix")
            print(f"| {cost} | {rate:g} | {med(runs, 'success'):.2%} | {med(runs, 'p99_ms'):.0f} |"
                  f" {med(runs, 'by_key', 'short', 'p50_ms'):.0f} |"
                  f" {med(runs, 'by_key', 'long', 'p99_ms'):.0f} | {med(runs, 'mean_batch'):.1f} |",
                  flush=True)  # fmt: skip


def minilm(seconds: float, repeats: int, rates: list[float]) -> None:
    from batchserve.models.minilm import load

    # The ceiling: the inputs the load generator will send, in their order, on the core the
    # server will have (its number of tokens per input sets the cost, so other texts would
    # make another ceiling).
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        model = load("cpu")
        texts = [plain_input(1, index) for index in range(int(max(rates) * seconds))]
        best = 0.0
        for size in (1, 8, 32, 64, 100):
            model(texts[:size])  # warm
            started, done = time.perf_counter(), 0
            while time.perf_counter() - started < 3:
                start = done % (len(texts) - size)
                model(texts[start : start + size])
                done += size
            rate = done / (time.perf_counter() - started)
            best = max(best, rate)
            print(f"direct, batch {size}: {rate:.0f} inputs/s", flush=True)
    finally:  # the rest of the run (it starts the server and the load) on every core again
        os.sched_setaffinity(0, affinity)
    setup = Setup("minilm", ("--devices", "cpu", "--fn-per-device",
                             "batchserve.models.minilm:load"), devices=0)  # fmt: skip
    print(f"\nceiling (direct, best batch): {best:.0f} inputs/s")
    print("| offered rps | success | p50 ms | p99 ms | mean batch | of the ceiling |")
    print("|---|---|---|---|---|---|")
    for rate in rates:
        runs = point(setup, rate, seconds, repeats)
        print(f"| {rate:g} | {med(runs, 'success'):.2%} | {med(runs, 'p50_ms'):.0f} |"
              f" {med(runs, 'p99_ms'):.0f} | {med(runs, 'mean_batch'):.1f} |"
              f" {med(runs, 'achieved_rps') / best:.2f} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "which",
        choices=["shared", "length", "minilm"],
        help="shared: two models and a flood; length: flat vs cost-aware; minilm: vs direct",
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each point, seconds")
    parser.add_argument("--repeats", type=int, default=3, help="runs per point (medians)")
    parser.add_argument("--rates", default="", help="comma-separated offered rates")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r]
    (ROOT / "benchmarks/results").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        if args.which == "shared":
            shared(Path(scratch), args.seconds, args.repeats)
        elif args.which == "length":
            length(Path(scratch), args.seconds, args.repeats, rates or [200, 400, 800, 1200])
        else:
            minilm(args.seconds, args.repeats, rates or [100, 200, 400, 600])


if __name__ == "__main__":
    sys.exit(main())
