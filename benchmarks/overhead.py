"""Server CPU time per answered request: batchserve with metrics on and off, and bare aiohttp.

The front end is CPU-bound (one event loop), so CPU per request sets the saturation rate:
on / off of that cost is the share of saturation throughput that metrics take, and
batchserve / bare is what batchserve costs on top of aiohttp itself. The bare handler holds
each request 100 ms (`bare_server.py --hold-ms 100`), so it keeps as many connections open
as batchserve does; the same handler with batchserve's answer (`--full-answer`: its fields,
id and headers) splits that into what the API's answer costs and what batching costs. The
same answer batched over 4 device threads with nothing else (`--batched 4`: no deadline,
check, fairness or metrics) is the floor for a batching server on aiohttp: one device call
a batch replaces a timer a request, so it costs less than the bare handler.
Servers run on core 0 (batchserve with D=4 simulated devices), load generators on core 1;
CPU time is read from /proc/PID/stat before and after the load.

By default the servers run at once (the floor in a second run, beside the bare handler
alone), each with its own load generator at `--rate`, and each repeat gives each server's
cost as a ratio to the bare handler's in the same seconds:
this machine's speed drifts by 10-30 % from minute to minute, which moves servers run one
after another apart by more than the 10 % to be told, while servers sharing the same seconds
drift together (ratios within about 1 % between repeats). `--apart` runs them one at a time,
alternating, at `--rate` each: absolute costs without the shared core, but noisy ratios.
Medians over repeats.

`--only` runs the bare handler with the servers named, at once: fewer processes share core 0
(each raises the others' cost, batchserve's most), so `--only on --rate 3000` is the pair at
the rate the issue "Performance" first measured at.

    python benchmarks/overhead.py                       # 6 repeats, all at once, about 2.5 minutes
    python benchmarks/overhead.py --apart --rate 3000   # one at a time, about 4 minutes
    python benchmarks/overhead.py --only on --rate 3000 # bare and metrics on, about 1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from progress import Progress
from servers import PORT, ROOT, start_server, stop_server

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


BARE = "bare aiohttp, 100 ms hold"
ON, OFF = "metrics on", "metrics off"
ANSWER = "bare, batchserve's answer"
FLOOR = "bare, batched"
BATCHSERVE = ["-m", "batchserve", "--devices", "sim:4", "--log-level", "WARNING"]
SERVERS = {
    ON: [*BATCHSERVE, "--metrics", "on"],
    OFF: [*BATCHSERVE, "--metrics", "off"],
    BARE: ["benchmarks/bare_server.py", "--hold-ms", "100"],
    ANSWER: ["benchmarks/bare_server.py", "--hold-ms", "100", "--full-answer"],
    FLOOR: [
        "benchmarks/bare_server.py",
        "--hold-ms",
        "100",
        "--full-answer",
        "--batched",
        "4",
    ],
}
SHORT_NAMES = {"on": ON, "off": OFF, "answer": ANSWER, "floor": FLOOR}
"""`--only`'s names for the servers other than the bare handler, which always runs."""


def run(servers: dict[str, list[str]], rate: float, seconds: float, seed: int) -> dict[str, float]:
    """Microseconds of server CPU per answered request of each of `servers`, all loaded at
    once, each at `rate` by its own load generator."""
    started: dict[str, tuple[subprocess.Popen[str], int]] = {}
    try:
        for offset, (name, args) in enumerate(servers.items()):
            port = PORT + offset
            started[name] = (start_server([sys.executable, *args, "--port", str(port)]), port)
        before = {name: cpu_seconds(server.pid) for name, (server, _) in started.items()}
        loads = {}
        for name, (_, port) in started.items():
            loads[name] = subprocess.Popen(
                ["taskset", "-c", "1", sys.executable, "benchmarks/loadgen.py",
                 "--url", f"http://127.0.0.1:{port}", "--rate", str(rate),
                 "--seconds", str(seconds), "--seed", str(seed)],
                cwd=ROOT, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
        answered = {}
        for name, load in loads.items():
            out, _ = load.communicate(timeout=seconds + 120)
            if load.returncode:
                raise RuntimeError(f"the load generator for {name} failed")
            answered[name] = json.loads(out)["ok"]
        return {
            name: 1e6 * (cpu_seconds(server.pid) - before[name]) / answered[name]
            for name, (server, _) in started.items()
        }
    finally:
        for server, _ in started.values():
            stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rate", type=float, help="offered requests/s per server (default 800, --apart 3000)"
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="each run's schedule")
    parser.add_argument("--repeats", type=int, default=6, help="repeats of each server (medians)")
    parser.add_argument(
        "--apart", action="store_true", help="one server at a time, alternating (noisy ratios)"
    )
    parser.add_argument(
        "--only", action="append", choices=SHORT_NAMES, metavar="NAME",
        help="run the bare handler and this server at once (repeat for more; one of"
        f" {', '.join(SHORT_NAMES)}); default: all, the floor in a run of its own",
    )  # fmt: skip
    args = parser.parse_args()
    if args.seconds <= 1 or args.repeats < 1:
        parser.error("--seconds must exceed the 1 s warm-up and --repeats be at least 1")
    if args.only and args.apart:
        parser.error("--only runs its servers at once; it does not go with --apart")
    rate = args.rate or (3000.0 if args.apart else 800.0)
    servers = SERVERS
    if args.only:
        chosen = [BARE, *(SHORT_NAMES[name] for name in args.only)]
        servers = {name: SERVERS[name] for name in chosen}
        groups = [servers]
    elif args.apart:
        groups = [{name: SERVERS[name]} for name in SERVERS]
    else:
        # The floor runs beside the bare handler alone: a fifth process on core 0 raised
        # every server's cost, batchserve's most (by 1-2 %).
        groups = [
            {name: command for name, command in SERVERS.items() if name != FLOOR},
            {name: SERVERS[name] for name in (BARE, FLOOR)},
        ]
    costs: dict[str, list[float]] = {name: [] for name in servers}
    ratios: dict[str, list[float]] = {name: [] for name in servers}
    progress = Progress(args.repeats * len(groups))
    for seed in range(1, args.repeats + 1):
        cycle: dict[str, float] = {}
        for group in groups:
            measured = run(group, rate, args.seconds, seed)
            for name, cost in measured.items():
                costs[name].append(cost)
                if not args.apart:  # against the bare handler in the same seconds
                    ratios[name].append(cost / measured[BARE])
            cycle |= measured
            progress.step(", ".join(f"{name}: {cost:.1f} us" for name, cost in measured.items()))
        if args.apart:
            for name in SERVERS:
                ratios[name].append(cycle[name] / cycle[BARE])
    median = {name: statistics.median(values) for name, values in costs.items()}
    ratio = {name: statistics.median(values) for name, values in ratios.items()}
    how = "apart, alternating" if args.apart else "all at once"
    print(f"{how}, {rate:g} rps each, {args.repeats} repeats; median us/request and median of"
          " the repeats' ratios to the bare handler:")  # fmt: skip
    for name in servers:
        each = "" if name == BARE else f" ({', '.join(f'{r:.3f}' for r in ratios[name])})"
        print(f"  {name}: {median[name]:.1f} us, {ratio[name]:.3f} x bare{each}")
    if not args.only:  # the summary needs every server
        on_off = statistics.median(on / off for on, off in zip(costs[ON], costs[OFF], strict=True))
        answer = ratio[ANSWER]
        print(
            f"on/off = {on_off:.3f} (saturation throughput with metrics = {1 / on_off:.3f} of"
            f" without); batchserve/bare = {ratio[ON]:.3f}, of which the answer"
            f" {answer:.3f} and batching {ratio[ON] / answer:.3f}; batchserve/floor"
            f" (bare, batched) = {ratio[ON] / ratio[FLOOR]:.3f}"
        )


if __name__ == "__main__":
    main()
