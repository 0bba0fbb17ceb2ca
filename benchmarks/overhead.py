"""Server CPU time per answered request: batchserve with metrics on and off, and bare aiohttp.

The front end is CPU-bound (one event loop), so CPU per request sets the saturation rate:
on / off of that cost is the share of saturation throughput that metrics take, and
batchserve / bare is what batchserve costs on top of aiohttp itself. The bare handler holds
each request 100 ms (`bare_server.py --hold-ms 100`), so it keeps as many connections open
as batchserve does; the same handler with batchserve's answer (`--full-answer`: its fields,
id and headers) splits that into what the API's answer costs and what batching costs. Each
run is a fresh server on core 0 (D=4 simulated devices) with the load generator on core 1;
CPU time is read from /proc/PID/stat before and after the load. The servers alternate, so
that drift hits each alike. Medians over repeats.

    python benchmarks/overhead.py            # 6 repeats x 4 servers, about 4 minutes
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


BATCHSERVE = ["-m", "batchserve", "--devices", "sim:4", "--log-level", "WARNING"]
SERVERS = {
    "metrics on": [*BATCHSERVE, "--metrics", "on"],
    "metrics off": [*BATCHSERVE, "--metrics", "off"],
    "bare aiohttp, 100 ms hold": ["benchmarks/bare_server.py", "--hold-ms", "100"],
    "bare, batchserve's answer": ["benchmarks/bare_server.py", "--hold-ms", "100", "--full-answer"],
}


def run(server_args: list[str], rate: float, seconds: float, seed: int) -> float:
    """Microseconds of server CPU per answered request."""
    server = start_server([sys.executable, *server_args, "--port", str(PORT)])
    try:
        before = cpu_seconds(server.pid)
        load = subprocess.run(
            ["taskset", "-c", "1", sys.executable, "benchmarks/loadgen.py",
             "--url", f"http://127.0.0.1:{PORT}", "--rate", str(rate),
             "--seconds", str(seconds), "--seed", str(seed)],
            cwd=ROOT, capture_output=True, text=True, check=True, timeout=seconds + 120,
        )  # fmt: skip
        used = cpu_seconds(server.pid) - before
        answered = json.loads(load.stdout)["ok"]
        return 1e6 * used / answered
    finally:
        stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=3000.0, help="offered requests/s")
    parser.add_argument("--seconds", type=float, default=8.0, help="each run's schedule")
    parser.add_argument(
        "--repeats", type=int, default=6, help="interleaved runs of each server (medians)"
    )
    args = parser.parse_args()
    if args.seconds <= 1 or args.repeats < 1:
        parser.error("--seconds must exceed the 1 s warm-up and --repeats be at least 1")
    costs: dict[str, list[float]] = {name: [] for name in SERVERS}
    progress = Progress(args.repeats * len(SERVERS))
    for seed in range(1, args.repeats + 1):
        for name, server_args in SERVERS.items():
            costs[name].append(run(server_args, args.rate, args.seconds, seed))
            progress.step(f"{name}: {costs[name][-1]:.1f} us/request")
    on, off, bare, full = (statistics.median(costs[name]) for name in SERVERS)
    print(
        f"median us/request: metrics on {on:.1f}, off {off:.1f}, bare aiohttp {bare:.1f},"
        f" bare with batchserve's answer {full:.1f}; on/off = {on / off:.3f} (saturation"
        f" throughput with metrics = {off / on:.3f} of without); batchserve/bare ="
        f" {on / bare:.3f}, of which the answer {full / bare:.3f} and batching {on / full:.3f}"
    )


if __name__ == "__main__":
    main()
