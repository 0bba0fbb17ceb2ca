"""batchserve beside the peer a user would otherwise pick (LitServe) and the bare handler.

All three serve the same simulated backend (a batch call takes 100 ms whatever its size, up
to 100 inputs, and answers each input reversed) on D = 1 and D = 4 simulated devices, each
on a fresh server pinned to core 0 with the same open-loop load generator on core 1.
The servers alternate at every point (so drift hits each alike) and the table gives medians
over repeats. The bare aiohttp handler holding each request 100 ms has no device limit: it is
the front end's own ceiling, not a competitor. A server is not offered higher rates once it
fails one badly (at the median, success below 90 % or p99 above 5 s), which would only cost
minutes.

- saturation: the highest offered rate with >= 99.9 % success and p99 <= 500 ms;
- goodput: the highest offered rate at which >= 99 % of requests get 200 within 200 ms
  (shed, failed and lost requests count as misses);
- p50 / p99 at 50, 200 and 900 rps (D=1) and 200, 1,000 and 3,500 rps (D=4).

Needs the `[bench]` extra (LitServe, pinned) and two cores.

    python benchmarks/peers.py                  # 3 repeats, about 30 minutes
    python benchmarks/peers.py --repeats 1 --seconds 4 --devices 4   # about 5 minutes
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from progress import Progress
from servers import PORT, ROOT
from sweep import add_length_flags, median, point_seconds, run_point

LADDERS = {
    1: [50, 200, 500, 700, 900, 950, 980],
    4: [200, 1000, 2000, 3000, 3500, 3800, 3900],
}
SHOWN = {1: [50, 200, 900], 4: [200, 1000, 3500]}
"""The rates whose p50 / p99 the table shows."""
GIVE_UP_SUCCESS, GIVE_UP_P99_MS = 0.90, 5000.0


@dataclass(frozen=True)
class Server:
    """One server under test on D devices; `run_point` needs `name`, `devices`, `command`."""

    name: str
    devices: int

    def command(self) -> list[str]:
        port = ["--port", str(PORT)]
        if self.name == "batchserve":
            return [sys.executable, "-m", "batchserve", "--devices", f"sim:{self.devices}",
                    "--log-level", "WARNING", *port]  # fmt: skip
        if self.name == "LitServe":
            return [sys.executable, "benchmarks/litserve_sim.py", "--workers", str(self.devices),
                    *port]  # fmt: skip
        return [sys.executable, "benchmarks/bare_server.py", "--hold-ms", "100", *port]


NAMES = ["batchserve", "LitServe", "bare aiohttp, 100 ms hold"]
Runs = list[dict[str, float]]


def measure(
    devices: int, seconds: float, min_requests: int, repeats: int, progress: Progress
) -> dict[str, dict[int, Runs]]:
    """Runs by server and offered rate, the servers interleaved at each point."""
    results: dict[str, dict[int, Runs]] = {name: {} for name in NAMES}
    active = list(NAMES)
    for rate in LADDERS[devices]:
        for seed in range(1, repeats + 1):
            for name in active:
                server = Server(name, devices)
                run = run_point(server, rate, point_seconds(seconds, min_requests, rate), seed)
                results[name].setdefault(rate, []).append(run)
                progress.step(f"D={devices} {rate} rps seed {seed} {name}: success"
                              f" {run['success']:.2%}, p99 {run['p99_ms']:.0f} ms")  # fmt: skip
        for name in list(active):
            runs = results[name][rate]
            if median(runs, "success") < GIVE_UP_SUCCESS or median(runs, "p99_ms") > GIVE_UP_P99_MS:
                active.remove(name)
    return results


def highest(by_rate: dict[int, Runs], good: Callable[[Runs], bool]) -> str:
    rates = [rate for rate, runs in by_rate.items() if good(runs)]
    return f"{max(rates):,}" if rates else "below the ladder"


def table(devices: int, results: dict[str, dict[int, Runs]]) -> list[str]:
    shown = SHOWN[devices]
    head = " | ".join(f"{rate:,} rps p50 / p99 ms" for rate in shown)
    lines = [f"| D={devices} | saturation rps | goodput rps | {head} |",
             "|---" * (3 + len(shown)) + "|"]  # fmt: skip
    for name in NAMES:
        by_rate = results[name]
        saturated = highest(
            by_rate, lambda runs: median(runs, "success") >= 0.999 and median(runs, "p99_ms") <= 500
        )
        goodput = highest(by_rate, lambda runs: median(runs, "good_share") >= 0.99)
        cells = [
            f"{median(by_rate[rate], 'p50_ms'):.0f} / {median(by_rate[rate], 'p99_ms'):.0f}"
            + ("" if median(by_rate[rate], "success") >= 0.999
               else f" ({median(by_rate[rate], 'success'):.1%} ok)")
            if rate in by_rate else "not run (failed a lower rate)"
            for rate in shown
        ]  # fmt: skip
        lines.append(f"| {name} | {saturated} | {goodput} | {' | '.join(cells)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_length_flags(parser, min_requests=1000)
    parser.add_argument("--devices", default="1,4", help="which D to run: 1, 4 or 1,4")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/peers.md", help="the table"
    )
    args = parser.parse_args()
    devices = [int(d) for d in args.devices.split(",")]
    if args.seconds <= 2 or args.repeats < 1 or not set(devices) <= set(LADDERS):
        parser.error("--seconds must exceed 2, --repeats be >= 1, --devices be 1, 4 or 1,4")
    if (os.cpu_count() or 0) < 2:
        parser.error("server and load are pinned to different cores: it needs two")
    total = sum(len(LADDERS[d]) for d in devices) * args.repeats * len(NAMES)
    progress = Progress(total)  # an upper bound: a server that gives up skips its rest
    lines = [f"{datetime.date.today()}, `python benchmarks/peers.py --seconds {args.seconds:g}"
             f" --repeats {args.repeats}`, medians:", ""]  # fmt: skip
    for d in devices:
        lines += [
            *table(d, measure(d, args.seconds, args.min_requests, args.repeats, progress)),
            "",
        ]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
