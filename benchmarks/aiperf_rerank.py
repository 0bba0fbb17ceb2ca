"""NVIDIA AIPerf's rankings endpoint types against batchserve's rerank routes (issue #42):
`hf-tei-rankings` (TEI's `POST /rerank`) and `cohere-rankings` (Cohere's `POST /v2/rerank`),
as a user of either would run them.

The reranker is `retrieval.py`'s: a randomly initialised BERT cross-encoder of
cross-encoder/ms-marco-MiniLM-L-6-v2's shape (seed 0, no download), served by batchserve on
core 0; AIPerf runs on core 1 with open-loop arrivals at each `--rates` rate, each request a
query and `--passages` synthetic passages. AIPerf cannot download a tokenizer: the reranker's
is laid out as an offline hub cache under a scratch HF_HOME of this script's own, removed on
exit. AIPerf pins its own dependencies, so it lives in its own venv (`--aiperf-venv`,
`.venv-aiperf`, gitignored), created with `pip install aiperf` when missing.

    python benchmarks/aiperf_rerank.py --rates 1,2,3 --requests 60

Prints one markdown row per endpoint type and rate: requests, errors, request latency p50 /
p99 and the throughput AIPerf measured. Exits 1 when a request failed or a run did not finish.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from retrieval import RESULTS, URL, batchserve, models_file, reranker, start
from servers import ROOT, stop_server

TOKENIZER_ID = "cross-encoder/ms-marco-MiniLM-L-6-v2"
"""The repo id AIPerf is given; the files are the reranker's own, in an offline cache."""
ENDPOINTS = {"hf-tei-rankings": "/rerank", "cohere-rankings": "/v2/rerank"}
SNAPSHOT = "0" * 40


def aiperf(venv: Path) -> Path:
    """AIPerf's command, installing it into its own venv the first time."""
    command = venv / "bin/aiperf"
    if not command.exists():
        print(f"installing AIPerf into {venv} (a few minutes, once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "aiperf"],
                       check=True, timeout=1800)  # fmt: skip
    return command


def offline_tokenizer(hf_home: Path, folder: Path) -> None:
    """The reranker's tokenizer as a hub cache entry AIPerf loads with HF_HUB_OFFLINE=1."""
    repo = hf_home / "hub" / f"models--{TOKENIZER_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text(SNAPSHOT)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json", "config.json"):  # fmt: skip
        shutil.copy(folder / name, snapshot / name)


def profile(command: Path, endpoint: str, rate: float, args: argparse.Namespace,
            scratch: Path) -> dict[str, Any] | None:  # fmt: skip
    """One AIPerf run; its summary, or None when it did not finish."""
    artifacts = RESULTS / "aiperf" / f"{endpoint}-{rate:g}rps"
    shutil.rmtree(artifacts, ignore_errors=True)
    env = {
        **os.environ, "HF_HOME": str(scratch / "hf"), "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(scratch), "AIPERF_DATASET_MMAP_CACHE_DIR": str(scratch / "mmap"),
    }  # fmt: skip
    run = [
        "taskset", "-c", "1", str(command), "profile", "--model", "rerank", "--url", URL,
        "--endpoint-type", endpoint, "--tokenizer", TOKENIZER_ID,
        "--request-rate", f"{rate:g}", "--request-count", str(args.requests),
        "--rankings-passages-mean", str(args.passages), "--rankings-passages-stddev", "0",
        "--rankings-passages-prompt-token-mean", str(args.passage_tokens),
        "--rankings-passages-prompt-token-stddev", "0",
        "--rankings-query-prompt-token-mean", str(args.query_tokens),
        "--rankings-query-prompt-token-stddev", "0", "--random-seed", "0",
        "--request-timeout-seconds", "60", "--no-gpu-telemetry", "--no-server-metrics",
        "--ui-type", "none", "--artifact-dir", str(artifacts),
    ]  # fmt: skip
    artifacts.mkdir(parents=True)
    with (artifacts / "console.txt").open("w") as console:
        done = subprocess.run(run, env=env, stdout=console, stderr=console, timeout=900,
                              start_new_session=True, check=False)  # fmt: skip
    summary = artifacts / "profile_export_aiperf.json"
    if done.returncode != 0 and not summary.exists():
        print(f"AIPerf failed ({done.returncode}): see {artifacts / 'console.txt'}", flush=True)
        return None
    result: dict[str, Any] = json.loads(summary.read_text())
    return result


def row(endpoint: str, rate: float, summary: dict[str, Any] | None) -> tuple[str, bool]:
    if summary is None:
        return f"| {endpoint} ({ENDPOINTS[endpoint]}) | {rate:g} | AIPerf failed | | | | |", False
    errors = sum(int(e.get("count", 0)) for e in summary.get("error_summary") or [])
    ok = int(summary.get("request_count", {}).get("avg") or 0)
    latency = summary.get("request_latency", {})
    throughput = summary.get("request_throughput", {}).get("avg") or 0.0
    return (
        f"| {endpoint} ({ENDPOINTS[endpoint]}) | {rate:g} | {ok + errors} | {errors} "
        f"| {latency.get('p50', float('nan')):.0f} | {latency.get('p99', float('nan')):.0f} "
        f"| {throughput:.2f} |",
        errors == 0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=lambda s: [float(r) for r in s.split(",")],
                        default=[1.0, 2.0], help="requests a second: one run each")  # fmt: skip
    parser.add_argument("--requests", type=int, default=40, help="requests in each run")
    parser.add_argument("--passages", type=int, default=10, help="passages in each request")
    parser.add_argument("--passage-tokens", type=int, default=64, help="tokens a passage")
    parser.add_argument("--query-tokens", type=int, default=8, help="tokens a query")
    parser.add_argument("--endpoints", default=",".join(ENDPOINTS),
                        help=f"AIPerf endpoint types, of {', '.join(ENDPOINTS)}")  # fmt: skip
    parser.add_argument("--aiperf-venv", type=Path, default=ROOT / ".venv-aiperf",
                        help="AIPerf's own venv, pip installs aiperf there if missing")  # fmt: skip
    args = parser.parse_args()
    endpoints = args.endpoints.split(",")
    command = aiperf(args.aiperf_venv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    folder = reranker(RESULTS / "reranker")
    lines = ["| AIPerf endpoint type (route) | rate (rps) | requests | errors | latency p50 ms "
             "| latency p99 ms | answered a second |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    passed = True
    with tempfile.TemporaryDirectory(prefix="aiperf_rerank.") as scratch_name:
        scratch = Path(scratch_name)
        offline_tokenizer(scratch / "hf", folder)
        server = start(batchserve(models_file(folder)), "/readyz")
        try:
            for endpoint in endpoints:
                for rate in args.rates:
                    line, ok = row(endpoint, rate, profile(command, endpoint, rate, args, scratch))
                    print(line, flush=True)
                    lines.append(line)
                    passed = passed and ok
        finally:
            stop_server(server)
    shown = subprocess.run([str(args.aiperf_venv / "bin/python"), "-m", "pip", "show", "aiperf"],
                           capture_output=True, text=True, check=False).stdout  # fmt: skip
    version = next((v.split()[-1] for v in shown.splitlines() if v.startswith("Version")), "?")
    print(
        f"\nAIPerf {version}, {args.passages} passages of {args.passage_tokens} tokens and a"
        f" {args.query_tokens}-token query a request; server on core 0, AIPerf on core 1\n"
    )
    print("\n".join(lines))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
