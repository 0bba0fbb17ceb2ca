"""What metrics cost per request: server CPU time per answered request, metrics on and off.

The front end is CPU-bound (one event loop), so CPU per request sets the saturation rate:
on / off of that cost is the share of saturation throughput that metrics take. Each run is a
fresh server on core 0 (D=4 simulated devices) with the load generator on core 1; CPU time
is read from /proc/PID/stat before and after the load. Medians over repeats.

    python benchmarks/overhead.py --repeats 3 --rate 3000 --seconds 8
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from sweep import PORT, ROOT

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def run(metrics: str, rate: float, seconds: float, seed: int) -> float:
    """Microseconds of server CPU per answered request."""
    log = (ROOT / "benchmarks/results/server.log").open("a")
    server = subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, "-m", "batchserve", "--port", str(PORT),
         "--devices", "sim:4", "--log-level", "WARNING", "--metrics", metrics],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        server.stdout.readline()
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
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=3000.0)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    costs: dict[str, list[float]] = {"on": [], "off": []}
    for seed in range(1, args.repeats + 1):
        for metrics in ("on", "off"):  # interleaved, so drift hits both alike
            costs[metrics].append(run(metrics, args.rate, args.seconds, seed))
            print(f"metrics {metrics}: {costs[metrics][-1]:.1f} us/request", flush=True)
    on, off = statistics.median(costs["on"]), statistics.median(costs["off"])
    print(
        f"median us/request: metrics on {on:.1f}, off {off:.1f}; on/off = {on / off:.3f};"
        f" saturation throughput with metrics = {off / on:.3f} of without"
    )


if __name__ == "__main__":
    main()
