"""The poison flood: one tenant sends failing inputs while the devices are mostly idle.

Four simulated 100 ms devices (capacity 4,000 rps) take 200 rps (5 %): with API keys,
50 % from an enterprise tenant, 25 % from a paid one and 25 % from a free tenant, "flood",
the only one whose requests carry poison (`--poison-key`); poison is 0, 5 % or 25 % of all
requests (20 % or all of the flood's). Without keys, the same shares of poison from one
tenant. The batch function's error names every input of its call (`naming_sim.py`), so an
error answer that carries another request's input is counted (`leaked`). Reports each
tenant's success (200s over its requests without poison) and p99 beside the run without
poison; each run on a fresh server pinned to core 0, the load on core 1, medians over seeds.

    flock /tmp/bench.lock python benchmarks/poison_flood.py --repeats 2   # ~4 minutes
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from servers import PORT, ROOT, run_loadgen, start_server, stop_server

KEYS_FILE = ROOT / "benchmarks/results/flood-keys.toml"
KEYS = """
[keys."sk-flood-ent"]
tenant = "ent"
tier = "enterprise"
[keys."sk-flood-paid"]
tenant = "paid"
tier = "paid"
[keys."sk-flood-flood"]
tenant = "flood"
tier = "free"

[tiers.enterprise]
rate = 1e6
burst = 1e6
[tiers.paid]
rate = 1e6
burst = 1e6
[tiers.free]
rate = 1e6
burst = 1e6
"""
SHARES = {"ent": 0.50, "paid": 0.25, "flood": 0.25}
RATE = 200.0
POISON = (0.0, 0.05, 0.25)
"""Poison as a share of all requests."""
NAMING = ("--fn-per-device", "benchmarks.naming_sim:load")


def run_point(server_args: tuple[str, ...], seconds: float, seed: int,
              load_args: tuple[str, ...]) -> dict:  # fmt: skip
    """One run on a fresh server (core 0) with the load generator on core 1: its summary.
    (as sweep.py's run_point, without sweep's matplotlib import or its /metrics read.)"""
    server = start_server([sys.executable, "-m", "batchserve", "--port", str(PORT), "--log-level",
                           "WARNING", "--devices", "sim:4", *server_args])  # fmt: skip
    try:
        return run_loadgen(RATE, seconds, seed, load_args)
    finally:
        stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per scenario (seeds)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/poison_flood.md",
                        help="where the table is written")  # fmt: skip
    args = parser.parse_args()
    KEYS_FILE.parent.mkdir(parents=True, exist_ok=True)
    KEYS_FILE.write_text(KEYS)
    keyed = ("--keys-file", str(KEYS_FILE), *NAMING)
    mix = ",".join(f"{name}=sk-flood-{name}:{share}" for name, share in SHARES.items())
    lines = [
        "| keys | poison (of all) | tenant | success | p50 ms | p99 ms | non-200 answers |"
        " poison answered 500 (run) | leaked | wrong | lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for poison in POISON:
        load = ("--keys", mix, "--poison-key", "flood", "--poison-rate",
                str(poison / SHARES["flood"]))  # fmt: skip
        runs = [run_point(keyed, args.seconds, seed, load)
                for seed in range(1, args.repeats + 1)]  # fmt: skip
        for name in SHARES:
            stats = [run["by_key"][name] for run in runs]  # type: ignore[index]
            lines.append(row("yes", poison, name, stats, runs))
            print(lines[-1], flush=True)
    for poison in POISON:
        runs = [run_point(NAMING, args.seconds, seed, ("--poison-rate", str(poison)))
                for seed in range(1, args.repeats + 1)]  # fmt: skip
        lines.append(row("no", poison, "(all)", runs, runs))
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


def row(keys: str, poison: float, name: str, stats: list[dict], runs: list[dict]) -> str:
    if not sum(int(s["sent"]) for s in stats):
        return f"| {keys} | {poison:.0%} | {name} | (sends only poison) | | | | | | | |"

    def median(key: str) -> float:
        return statistics.median(float(s[key]) for s in stats)

    errors: dict[str, int] = {}
    for s in stats:
        for status, count in s["statuses"].items():
            if status != "200":
                errors[status] = errors.get(status, 0) + count
    return (
        f"| {keys} | {poison:.0%} | {name} | {median('success'):.2%} | {median('p50_ms'):.0f} |"
        f" {median('p99_ms'):.0f} |"
        f" {', '.join(f'{k}: {v}' for k, v in sorted(errors.items())) or '-'} |"
        f" {sum(int(r['poison_500']) for r in runs)} of {sum(int(r['poison_sent']) for r in runs)}"
        f" | {sum(int(r['leaked']) for r in runs)} | {sum(int(r['wrong_output']) for r in runs)} |"
        f" {sum(int(r['unanswered']) for r in runs)} |"
    )


if __name__ == "__main__":
    main()
