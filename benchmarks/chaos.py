"""The chaos run: 70% of capacity with poison inputs and one device hanging once.

Four simulated 100 ms devices (capacity 4,000 rps) take 2,800 rps. Scenarios run side by
side, each on a fresh server pinned to core 0 with the load generator on core 1, and the
table gives medians over repeats. Poison inputs must come back 500; every other request
should succeed, and none may be lost or answered with another's output.

    python benchmarks/chaos.py --repeats 3 --out benchmarks/results/chaos.md
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from sweep import ROOT, Setup, median, run_point

RATE = 2800.0
HANG_MS = "3000"


@dataclass(frozen=True)
class Scenario:
    name: str
    server_args: tuple[str, ...]
    load_args: tuple[str, ...]


def scenarios(seconds: float) -> list[Scenario]:
    hang = ("--hang-at-s", str(seconds / 2))
    return [
        Scenario("fault-free", (), ()),
        Scenario("1% poison + one hang", (), ("--poison-rate", "0.01", *hang)),
        Scenario(
            "1% poison + one hang, no isolation",
            ("--bisect-failures", "off"),
            ("--poison-rate", "0.01", *hang),
        ),
        Scenario("0.1% poison + one hang", (), ("--poison-rate", "0.001", *hang)),
        Scenario("0.01% poison + one hang", (), ("--poison-rate", "0.0001", *hang)),
        Scenario("one hang only", (), hang),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/chaos.md")
    args = parser.parse_args()
    lines = [
        "| scenario | non-poison success | poison answered 500 | p50 ms | p99 ms |"
        " p99 / fault-free p99 | lost | wrong outputs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    baseline_p99 = None
    for scenario in scenarios(args.seconds):
        setup = Setup("adaptive", ("--sim-hang-ms", HANG_MS, *scenario.server_args), 4)
        results = [
            run_point(setup, RATE, args.seconds, seed, scenario.load_args)
            for seed in range(1, args.repeats + 1)
        ]
        p99 = median(results, "p99_ms")
        baseline_p99 = baseline_p99 or p99
        poison = sum(int(r["poison_sent"]) for r in results)
        poison_500 = sum(int(r["poison_500"]) for r in results)
        line = (
            f"| {scenario.name} | {median(results, 'success'):.2%} |"
            f" {poison_500} of {poison} | {median(results, 'p50_ms'):.0f} | {p99:.0f} |"
            f" {p99 / baseline_p99:.2f} | {sum(int(r['unanswered']) for r in results)} |"
            f" {sum(int(r['wrong_output']) for r in results)} |"
        )
        lines.append(line)
        print(line, flush=True)
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
