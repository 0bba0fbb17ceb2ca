"""Runs every benchmark point and writes a markdown table of medians over repeats.

Each point starts a fresh server pinned to core 0 (`taskset -c 0`) and the open-loop load
generator pinned to core 1, so the two never share a core. Policies run side by side on the
same simulated 100 ms backend, with the bare aiohttp handler measured in the same run.
Machines differ 2-3x in speed per request, so the run first measures B, the bare handler's
saturation rate on this machine, and the targets' loads are fractions of B (see TARGETS).

    python benchmarks/sweep.py --repeats 3           # about 25 minutes
    python benchmarks/sweep.py --repeats 1 --quick   # the target points only, about 3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from plots import write_plots
from progress import Progress
from servers import PORT, ROOT, run_loadgen, start_server, stop_server


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
ADAPTIVE_16 = setups(16)[0]


@dataclass(frozen=True)
class Target:
    """A load of `share` x B on `setup`, and the p99 it must keep."""

    setup: Setup
    share: float
    p99_ms: float

    def rate(self, bare_rps: float) -> int:
        return round(self.share * bare_rps / 10) * 10


TARGETS = [Target(ADAPTIVE_4, 0.145, 140.0), Target(ADAPTIVE_16, 0.33, 150.0)]
SATURATION_SHARE, SATURATION_RPS = 0.16, 3900
"""D=4 must saturate at >= 3,900 rps wherever 0.16 x B reaches that."""


def plan(bare_rps: float, quick: bool) -> list[tuple[Setup, list[int]]]:
    """The fixed ladders, with each target's B-scaled rate added to its setup's."""
    extra = {target.setup: target.rate(bare_rps) for target in TARGETS}
    if quick:
        return [(setup, [rate]) for setup, rate in extra.items()]
    ladders: list[tuple[Setup, list[int]]] = [
        (ADAPTIVE_4, [50, 200, 1000, 2000, 3000, 3500, 3800, 3900]),
        (FIXED_4, [50, 200, 1000, 2000, 3500]),
        (UNBATCHED_4, [30, 50]),
        (ADAPTIVE_1, [100, 500, 900, 950, 980]),
        (FIXED_1, [20, 100, 900]),
        (ADAPTIVE_16, [4000, 5000, 6000, 7000, 8000]),
        (BARE, [5000, 6000, 7000, 8000]),
    ]
    return [
        (setup, sorted({*rates, extra[setup]} if setup in extra else rates))
        for setup, rates in ladders
    ]


BARE_OFFERS = (12_000, 16_000, 20_000, 24_000)
"""Offered loads B is measured at: above the bare handler's saturation on the machines seen
(11,000 to 24,000 rps), yet not so far above that the load generator, on its own core,
spends itself scheduling sends (offered 40,000 it delivered less than offered 16,000)."""


def bare_saturation(seconds: float, repeats: int) -> float:
    """B: the most answers a second the bare handler (no hold) gives at any of BARE_OFFERS,
    medians over repeats; the yardstick every target's load is scaled by."""
    return max(
        median(
            [
                run_point(BARE, rate, seconds, seed, ("--connections", "1000"))
                for seed in range(1, repeats + 1)
            ],
            "achieved_rps",
        )
        for rate in BARE_OFFERS
    )


class Launchable(Protocol):
    """A server a point can run against: sweep's setups, peers' servers."""

    def command(self) -> list[str]: ...


def add_length_flags(parser: argparse.ArgumentParser, *, min_requests: int) -> None:
    """--seconds, --min-requests and --repeats: how long each point runs, and how often."""
    parser.add_argument(
        "--seconds",
        type=float,
        default=8.0,
        help="each point's schedule; its first second is warm-up (checked, not timed)",
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=min_requests,
        help="a light-load point runs longer, so that its p99 rests on this many requests",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per point (medians)")


def point_seconds(seconds: float, min_requests: int, rate: float) -> float:
    return max(seconds, min_requests / rate)


def run_point(
    setup: Launchable, rate: float, seconds: float, seed: int, load_args: tuple[str, ...] = ()
) -> dict[str, float]:
    server = start_server(setup.command())
    try:
        return {**run_loadgen(rate, seconds, seed, load_args), "server": server_counters()}
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Needs two cores; writes the table, its JSON and the PNGs under results/.",
    )
    add_length_flags(parser, min_requests=2000)
    parser.add_argument("--quick", action="store_true", help="measure B and the target points only")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/sweep.md", help="the table"
    )
    parser.add_argument(
        "--plots",
        type=Path,
        default=ROOT / "benchmarks/results/plots",
        help="where the PNGs go (benchmarks/plots holds the committed ones)",
    )
    args = parser.parse_args()
    if args.seconds <= 2:
        parser.error("--seconds must exceed 2: the first second of each point is warm-up")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if (os.cpu_count() or 0) < 2:
        parser.error("the sweep pins server and load to different cores: it needs two")
    return args


def main() -> None:
    args = parse_args()
    bare_rps = bare_saturation(min(args.seconds, 4.0), args.repeats)
    print(f"B (bare aiohttp saturation on this machine) = {bare_rps:.0f} rps", flush=True)
    lines = [
        f"B = {bare_rps:.0f} rps (bare aiohttp's saturation, measured in this run)",
        "",
        "| setup | D | offered rps | success | achieved / capacity | p50 ms | p99 ms |"
        " mean batch | wrong outputs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    points: list[dict[str, object]] = []
    ladders = plan(bare_rps, args.quick)
    progress = Progress(sum(len(rates) for _, rates in ladders) * args.repeats)
    for setup, rates in ladders:
        for rate in rates:
            seconds = point_seconds(args.seconds, args.min_requests, rate)
            results = []
            for seed in range(1, args.repeats + 1):
                results.append(run_point(setup, rate, seconds, seed))
                progress.step(f"{setup.name} D={setup.devices} {rate} rps seed {seed}")
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
    saturation: dict[tuple[str, int], int] = {}
    for (name, devices), ladder in rows.items():
        good = [rate for rate, success, p99 in ladder if success >= 0.999 and p99 <= 500]
        saturation[(name, devices)] = max(good, default=0)
        lines.append(f"| {name} | {devices or 'n/a'} | {max(good) if good else 'below ladder'} |")
    lines += ["", *target_lines(bare_rps, rows, saturation.get(("adaptive", 4)))]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(points))
    print(text)
    if not args.quick:
        for path in write_plots(points, args.plots):
            print(f"wrote {path}")


def target_lines(
    bare_rps: float,
    rows: dict[tuple[str, int], list[tuple[int, float, float]]],
    saturation_4: int | None,
) -> list[str]:
    """Each target with its B-scaled load, what was measured and whether it was met."""
    lines = ["| target | load on this machine | measured | met |", "|---|---|---|---|"]
    for target in TARGETS:
        rate = target.rate(bare_rps)
        key = (target.setup.name, target.setup.devices)
        p99 = next(p99 for r, _, p99 in rows[key] if r == rate)
        lines.append(
            f"| D={target.setup.devices} at {target.share} x B: p99 <= {target.p99_ms:g} ms |"
            f" {rate} rps | p99 {p99:.0f} ms | {'yes' if p99 <= target.p99_ms else 'NO'} |"
        )
    reach = SATURATION_SHARE * bare_rps
    if saturation_4 is not None:
        applies = reach >= SATURATION_RPS
        lines.append(
            f"| D=4 saturation >= {SATURATION_RPS} rps where {SATURATION_SHARE} x B >= that |"
            f" {SATURATION_SHARE} x B = {reach:.0f} rps | {saturation_4} rps |"
            f" {('yes' if saturation_4 >= SATURATION_RPS else 'NO') if applies else 'n/a here'} |"
        )
    return lines


if __name__ == "__main__":
    main()
