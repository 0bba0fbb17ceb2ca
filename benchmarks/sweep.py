"""Runs every benchmark point and writes a markdown table of medians over repeats.

Each point starts a fresh server pinned to core 0 (`taskset -c 0`) and the open-loop load
generator pinned to core 1, so the two never share a core. Policies run side by side on the
same simulated 100 ms backend, with the bare aiohttp handler measured in the same run.

    python benchmarks/sweep.py --repeats 3 --out benchmarks/results/sweep.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from plots import write_plots
from servers import ROOT, start_server, stop_server

PORT = 8765


@dataclass(frozen=True)
class Setup:
    name: str
    args: tuple[str, ...]
    devices: int
    batch_limit: int = 100

    @property
    def capacity_rps(self) -> float:
        """Devices x batch limit x 10 batches/s: the simulated 100 ms backend's ceiling."""
        return self.devices * self.batch_limit * 10.0

    def command(self) -> list[str]:
        if self.name == "bare aiohttp":
            return [sys.executable, "benchmarks/bare_server.py", "--port", str(PORT)]
        return [sys.executable, "-m", "batchserve", "--port", str(PORT), "--log-level",
                "WARNING", "--devices", f"sim:{self.devices}", *self.args]  # fmt: skip


def setups(devices: int) -> list[Setup]:
    return [
        Setup("adaptive", (), devices),
        Setup(
            "fixed 32/50ms",
            ("--policy", "fixed", "--max-batch-size", "32", "--max-linger-ms", "50"),
            devices,
            batch_limit=32,
        ),
        Setup("no batching", ("--max-batch-size", "1"), devices, batch_limit=1),
    ]


BARE = Setup("bare aiohttp", (), 0)
ADAPTIVE_4, FIXED_4, UNBATCHED_4 = setups(4)
ADAPTIVE_1, FIXED_1, _ = setups(1)
PLAN: list[tuple[Setup, list[int]]] = [
    (ADAPTIVE_4, [50, 200, 1000, 2000, 3000, 3500, 3800, 3900]),
    (FIXED_4, [50, 200, 1000, 2000, 3500]),
    (UNBATCHED_4, [30, 50]),
    (ADAPTIVE_1, [100, 500, 900, 950, 980]),
    (FIXED_1, [20, 100, 900]),
    (setups(16)[0], [4000, 5000, 6000, 7000, 8000]),
    (BARE, [5000, 6000, 7000, 8000]),
]


def run_point(
    setup: Setup, rate: float, seconds: float, seed: int, load_args: tuple[str, ...] = ()
) -> dict[str, float]:
    server = start_server(setup.command())
    try:
        load = subprocess.run(
            ["taskset", "-c", "1", sys.executable, "benchmarks/loadgen.py",
             "--url", f"http://127.0.0.1:{PORT}", "--rate", str(rate),
             "--seconds", str(seconds), "--seed", str(seed), *load_args],
            cwd=ROOT, capture_output=True, text=True, timeout=seconds + 120, check=True,
        )  # fmt: skip
        return {**json.loads(load.stdout), "server": server_counters()}
    finally:
        stop_server(server)


COUNTERS = re.compile(r'^batchserve_(recoveries|faults)_total\{kind="([a-z_]+)"\} (\S+)$', re.M)


def server_counters() -> dict[str, float]:
    """The server's fault and recovery counters, read from /metrics before it stops."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    except urllib.error.URLError:  # --metrics off
        return {}
    return {f"{family}.{kind}": float(value) for family, kind, value in COUNTERS.findall(text)}


def median(results: list[dict[str, float]], key: str) -> float:
    return statistics.median(float(result[key]) for result in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument(
        "--min-requests",
        type=int,
        default=2000,
        help="a light-load point runs longer, so that its p99 rests on this many requests",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/sweep.md")
    parser.add_argument(
        "--plots", type=Path, default=ROOT / "benchmarks/plots", help="where the PNGs go"
    )
    args = parser.parse_args()
    if os.cpu_count() is not None and (os.cpu_count() or 0) < 2:
        sys.exit("the sweep pins server and load to different cores: it needs two")
    lines = [
        "| setup | D | offered rps | success | achieved / capacity | p50 ms | p99 ms |"
        " mean batch | wrong outputs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    points: list[dict[str, object]] = []
    for setup, rates in PLAN:
        for rate in rates:
            seconds = max(args.seconds, args.min_requests / rate)
            results = [run_point(setup, rate, seconds, seed) for seed in range(1, args.repeats + 1)]
            points.append({"setup": setup.name, "devices": setup.devices, "rate": rate,
                           "runs": results})  # fmt: skip
            success, p99 = median(results, "success"), median(results, "p99_ms")
            rows.setdefault((setup.name, setup.devices), []).append((rate, success, p99))
            achieved = median(results, "achieved_rps")
            ratio = f"{achieved / setup.capacity_rps:.3f}" if setup.devices else "n/a"
            line = (
                f"| {setup.name} | {setup.devices or 'n/a'} | {rate:g} | {success:.2%} | {ratio} |"
                f" {median(results, 'p50_ms'):.0f} | {p99:.0f} |"
                f" {median(results, 'mean_batch'):.1f} |"
                f" {sum(int(r['wrong_output']) for r in results)} |"
            )
            lines.append(line)
            print(line, flush=True)
    lines += ["", "| setup | D | saturation rps (>= 99.9 % success, p99 <= 500 ms) |"]
    lines += ["|---|---|---|"]
    for (name, devices), ladder in rows.items():
        good = [rate for rate, success, p99 in ladder if success >= 0.999 and p99 <= 500]
        lines.append(f"| {name} | {devices or 'n/a'} | {max(good) if good else 'below ladder'} |")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(points))
    print(text)
    for path in write_plots(points, args.plots):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
