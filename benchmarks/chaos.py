"""The chaos run: poison inputs, a device that hangs once, one that breaks, a retry loop.

Four simulated 100 ms devices (capacity 4,000 rps) take 2,800 rps (70 %) or 1,200 (30 %).
Scenarios run side by side, each on a fresh server pinned to core 0 with the load generator
on core 1, and the table gives medians over repeats. Poison inputs must come back 500; every
other request should succeed, and none may be lost or answered with another's output.
Beside each success rate: the best any server could reach under the backend contract (a
call raises or answers all its inputs) at that load, and our fraction of it.

    python benchmarks/chaos.py --repeats 3 --out benchmarks/results/chaos.md   # ~8 minutes
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from sweep import ROOT, Setup, median, run_point

CAPACITY_CALLS_S = 4 / 0.100
"""Calls a second the four 100 ms devices make."""
BATCH_LIMIT = 100
HANG_MS = "3000"


@dataclass(frozen=True)
class Scenario:
    name: str
    rate: float
    server_args: tuple[str, ...] = ()
    load_args: tuple[str, ...] = ()
    poison_rate: float = 0.0


def scenarios(seconds: float) -> list[Scenario]:
    hang = ("--hang-at-s", str(seconds / 2))
    broken = ("--fn-per-device", "benchmarks.broken_sim:load")
    return [
        Scenario("fault-free", 2800),
        Scenario("one hang only", 2800, load_args=hang),
        Scenario("0.1% poison, 30 % load", 1200, (), ("--poison-rate", "0.001"), 0.001),
        Scenario("0.1% poison, 70 % load", 2800, (), ("--poison-rate", "0.001"), 0.001),
        Scenario("0.1% poison + one hang", 2800, (), ("--poison-rate", "0.001", *hang), 0.001),
        Scenario("1% poison + one hang", 2800, (), ("--poison-rate", "0.01", *hang), 0.01),
        Scenario(
            "1% poison + one hang, no isolation",
            2800,
            ("--bisect-failures", "off"),
            ("--poison-rate", "0.01", *hang),
            0.01,
        ),
        Scenario("one poison input sent 100 times", 2800, (), ("--repeat-poison", "100")),
        Scenario(
            "the same, --poison-memory 0",
            2800,
            ("--poison-memory", "0"),
            ("--repeat-poison", "100"),
        ),
        Scenario("sim:0 raises on every call from 5 s", 2800, broken),
    ]


def best_success(rate: float, poison_rate: float) -> float:
    """The most non-poison requests any server can answer, as a share: each needs a call
    with no poison input in it, a call of n succeeds with probability (1 - p)^n, and the
    devices make CAPACITY_CALLS_S calls a second (finding the poison costs calls as well,
    so the true bound is lower still)."""
    clean_rps = rate * (1 - poison_rate)
    per_call = max(n * (1 - poison_rate) ** n for n in range(1, BATCH_LIMIT + 1))
    return min(1.0, CAPACITY_CALLS_S * per_call / clean_rps)


def counter(results: list[dict], name: str) -> float:
    return statistics.median(float(r["server"].get(name, 0.0)) for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per scenario (seeds)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/chaos.md",
                        help="where the table is written")  # fmt: skip
    parser.add_argument("--verbose", action="store_true",
                        help="also print each run's HTTP statuses and server counters")  # fmt: skip
    parser.add_argument("--only", default="",
                        help="run only the scenarios whose name contains this text")  # fmt: skip
    args = parser.parse_args()
    lines = [
        "| scenario | non-poison success | best possible | of it | poison answered 500 |"
        " p50 ms | p99 ms | p99 last third ms | lost | wrong | rescue calls / isolated |"
        " rounds / isolated | rides (failed) | fresh batches failed | restarts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    all_scenarios = [s for s in scenarios(args.seconds) if args.only in s.name]
    for done, scenario in enumerate(all_scenarios, 1):
        setup = Setup("adaptive", ("--sim-hang-ms", HANG_MS, *scenario.server_args), 4)
        results = [
            run_point(setup, scenario.rate, args.seconds, seed, scenario.load_args)
            for seed in range(1, args.repeats + 1)
        ]
        success = median(results, "success")
        best = best_success(scenario.rate, scenario.poison_rate)
        isolated = counter(results, "recoveries.poison_isolated")
        per_isolated = (
            f"{counter(results, 'recoveries.rescue_calls') / isolated:.1f} |"
            f" {counter(results, 'recoveries.isolation_rounds') / isolated:.1f}"
            if isolated
            else "- | -"
        )
        line = (
            f"| {scenario.name} | {success:.2%} | {best:.0%} | {success / best:.2f} |"
            f" {sum(int(r['poison_500']) for r in results)} of"
            f" {sum(int(r['poison_sent']) for r in results)} |"
            f" {median(results, 'p50_ms'):.0f} | {median(results, 'p99_ms'):.0f} |"
            f" {median(results, 'last_third_p99_ms'):.0f} |"
            f" {sum(int(r['unanswered']) for r in results)} |"
            f" {sum(int(r['wrong_output']) for r in results)} | {per_isolated} |"
            f" {counter(results, 'recoveries.rides'):.0f}"
            f" ({counter(results, 'recoveries.rides_failed'):.0f}) |"
            f" {counter(results, 'recoveries.first_try_batches_failed'):.0f} |"
            f" {counter(results, 'faults.device_restarted'):.0f} |"
        )
        lines.append(line)
        print(f"[{done}/{len(all_scenarios)}] {line}", flush=True)
        if args.verbose:
            for result in results:
                print(result["statuses"], result["server"], flush=True)
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
