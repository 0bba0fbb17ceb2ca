"""Tiers under overload: 150% of capacity, 5% enterprise, 25% paid, 70% free, one free
tenant flooding. Reports each tenant's success and latency, and the quiet free tenant's p99
against a run without the flood.

Four simulated devices with 400 ms calls (capacity 1,000 rps, so that 150 % stays well inside
what one core's HTTP front end serves); the server pinned to core 0, the load to core 1.

    python benchmarks/tiers.py --repeats 3 --out benchmarks/results/tiers.md
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from sweep import ROOT, Setup, run_point

KEYS_FILE = ROOT / "benchmarks/results/bench-keys.toml"
KEYS = """
[keys."sk-bench-ent"]
tenant = "ent"
tier = "enterprise"
[keys."sk-bench-paid"]
tenant = "paid"
tier = "paid"
[keys."sk-bench-flood"]
tenant = "flood"
tier = "free"
[keys."sk-bench-quiet"]
tenant = "quiet"
tier = "free"

[tiers.enterprise]
rate = 1e6
burst = 1e6
timeout_ms = 5000
[tiers.paid]
rate = 1e6
burst = 1e6
timeout_ms = 3000
[tiers.free]
rate = 1e6
burst = 1e6
timeout_ms = 2000
"""
CAPACITY = 1000.0
TENANTS = {"ent": "enterprise", "paid": "paid", "flood": "free", "quiet": "free"}
FLOOD = {"ent": 0.05, "paid": 0.25, "flood": 0.60, "quiet": 0.10}


def mix(shares: dict[str, float]) -> str:
    return ",".join(f"{name}=sk-bench-{name}:{share}" for name, share in shares.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each run, seconds")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per scenario, seeds 1.. (medians)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks/results/tiers.md",
        help="where the table is written",
    )
    args = parser.parse_args()
    KEYS_FILE.parent.mkdir(parents=True, exist_ok=True)
    KEYS_FILE.write_text(KEYS)
    setup = Setup("adaptive", ("--keys-file", str(KEYS_FILE), "--sim-latency-ms", "400"), 4)
    quiet_alone = {name: share for name, share in FLOOD.items() if name != "flood"}
    scenarios = {
        "150 % with the flood": (1.5 * CAPACITY, FLOOD),
        "without the flood": (1.5 * CAPACITY * sum(quiet_alone.values()), quiet_alone),
    }
    lines = [
        "| scenario | tenant (tier) | offered rps | success | p50 ms | p99 ms | answers |",
        "|---|---|---|---|---|---|---|",
    ]
    for scenario, (rate, shares) in scenarios.items():
        total = sum(shares.values())
        runs = [
            run_point(setup, rate, args.seconds, seed, ("--keys", mix(shares)))
            for seed in range(1, args.repeats + 1)
        ]
        for name, share in shares.items():
            stats = [run["by_key"][name] for run in runs]  # type: ignore[index]

            def median(key: str, stats: list[dict[str, float]] = stats) -> float:
                return statistics.median(float(s[key]) for s in stats)

            answers: dict[str, int] = {}
            for s in stats:
                for status, count in s["statuses"].items():  # type: ignore[attr-defined]
                    answers[status] = answers.get(status, 0) + count
            line = (
                f"| {scenario} | {name} ({TENANTS[name]}) | {rate * share / total:.0f} |"
                f" {median('success'):.2%} | {median('p50_ms'):.0f} | {median('p99_ms'):.0f} |"
                f" {', '.join(f'{k}: {v}' for k, v in sorted(answers.items()))} |"
            )
            lines.append(line)
            print(line, flush=True)
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
