"""What scraping /metrics costs the server: its CPU with and without a scraper, under load.

The inference gateway's endpoint picker scrapes every pod every 50 ms (20 a second), so a
scrape must be cheap beside the requests. One batchserve server (4 simulated devices) runs on
core 0 under an open-loop load of `--rate` requests a second (loadgen.py, core 1) for the
whole run; the run is cut into windows of `--window-s` seconds, and each repeat has three:
no scraper, a scraper at `--scrapes` a second and one at ten times that (the same cost,
ten times over the noise, for the cost of one scrape). The server's CPU time is read from
/proc/PID/stat at each window's edges; the scraper and this script run on core 1. Medians
over repeats; the cost of scraping is (CPU with - CPU without) / window, in cores.

With a --metrics-max-age-ms above 0 (`--max-age-ms`; the server's default, 500, if not
given), /metrics renders everything once per max age and reuses that render but for the
picker's gauges in between: the 10x window then spreads one full render over ten times the
scrapes, so its per-scrape figure is the cost of a reused scrape, not of the average one at
`--scrapes`. Combine it with a run at `--max-age-ms 0` (every scrape a full render): at S
scrapes a second, 1000 / max age full renders and the rest reused.

    flock /tmp/bench.lock python benchmarks/scrape_cost.py          # 3 repeats, about 1.5 min
    flock /tmp/bench.lock python benchmarks/scrape_cost.py --max-age-ms 0
    flock /tmp/bench.lock python benchmarks/scrape_cost.py --path /metrics/picker
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from servers import PORT, ROOT, start_server, stop_server

TICKS = os.sysconf("SC_CLK_TCK")
WARMUP_S = 3.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def scrape_for(seconds: float, rate: float, path: str) -> int:
    """GET `path` `rate` times a second for `seconds`, on schedule, over one kept-alive
    connection as the picker's HTTP client keeps it; the scrapes made."""
    if rate <= 0:
        time.sleep(seconds)
        return 0
    connection = http.client.HTTPConnection("127.0.0.1", PORT, timeout=5)
    start = time.monotonic()
    done = 0
    try:
        while (due := start + done / rate) < start + seconds:
            time.sleep(max(0.0, due - time.monotonic()))
            connection.request("GET", path)
            answer = connection.getresponse()
            answer.read()
            assert answer.status == 200, answer.status
            done += 1
    finally:
        connection.close()
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="requests a second")
    parser.add_argument("--scrapes", type=float, default=20.0, help="scrapes a second")
    parser.add_argument("--window-s", type=float, default=8.0, help="one window's length, seconds")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="sets of three windows: none, --scrapes, 10x (medians)",
    )
    parser.add_argument(
        "--path",
        default="/metrics",
        help="what is scraped: /metrics, or the picker's"
        " /metrics/picker (the path deploy/k8s/gateway/epp.yaml gives it)",
    )
    parser.add_argument(
        "--max-age-ms", type=float, default=None,
        help="the server's --metrics-max-age-ms (default: the server's own default)",
    )  # fmt: skip
    args = parser.parse_args()
    os.sched_setaffinity(0, {1})
    max_age = [] if args.max_age_ms is None else ["--metrics-max-age-ms", f"{args.max_age_ms:g}"]
    rates = (0.0, args.scrapes, 10 * args.scrapes)
    total_s = WARMUP_S + args.repeats * len(rates) * args.window_s + 2
    server = start_server(
        [sys.executable, "-m", "batchserve", "--devices", "sim:4", "--log-level", "WARNING",
         "--port", str(PORT), *max_age], "scrape_cost.log",
    )  # fmt: skip
    load = subprocess.Popen(
        ["taskset", "-c", "1", sys.executable, "benchmarks/loadgen.py",
         "--url", f"http://127.0.0.1:{PORT}", "--rate", str(args.rate),
         "--seconds", str(total_s), "--seed", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    cores: dict[float, list[float]] = {rate: [] for rate in rates}
    try:
        time.sleep(WARMUP_S)
        for repeat in range(args.repeats):
            order = rates if repeat % 2 == 0 else rates[::-1]
            for rate in order:
                before, started = cpu_seconds(server.pid), time.monotonic()
                made = scrape_for(args.window_s, rate, args.path)
                elapsed = time.monotonic() - started
                cores[rate].append((cpu_seconds(server.pid) - before) / elapsed)
                print(f"repeat {repeat} scrapes/s {made / elapsed:6.1f}: server"
                      f" {cores[rate][-1]:.4f} cores", file=sys.stderr)  # fmt: skip
        summary = json.loads(load.communicate(timeout=total_s + 120)[0])
    finally:
        if load.poll() is None:
            load.kill()
        stop_server(server)
    without = statistics.median(cores[0.0])
    per_scrape_s = statistics.median(
        (with_ - base) / rates[2] for with_, base in zip(cores[rates[2]], cores[0.0], strict=True)
    )
    result = {
        "path": args.path,
        "metrics_max_age_ms": args.max_age_ms,
        "rate": args.rate,
        "achieved_rps": summary["achieved_rps"],
        "success": summary["success"],
        "p99_ms": summary["p99_ms"],
        "server_cores_without_scrapes": without,
        f"server_cores_at_{args.scrapes:g}_scrapes_per_s": statistics.median(cores[rates[1]]),
        f"scrape_cost_cores_at_{args.scrapes:g}_per_s_direct": statistics.median(
            w - b for w, b in zip(cores[rates[1]], cores[0.0], strict=True)
        ),
        "cpu_ms_per_scrape_from_10x": per_scrape_s * 1e3,
        f"scrape_cost_cores_at_{args.scrapes:g}_per_s_from_10x": per_scrape_s * args.scrapes,
        "windows": {str(rate): values for rate, values in cores.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
