"""What any server could do with the rerank benchmark's requests on one core: the ceiling
and the best tail at the goal (benchmarks/retrieval.py's `rerank`, issue #42).

`ms_per_pair`: the cross-encoder called directly (transformers, one torch thread, pinned to
core 0) on the benchmark's pairs at several batch sizes, in CPU time of the calling thread,
so that other work on the machine does not inflate it; as transformers runs it, or with its
linears by weights packed for oneDNN (`packed`, as batchserve's cross-encoder runs them:
torch's plain `linear` is MKL's, which on an AMD CPU takes its AVX2 code). The ideal below
takes the faster.

`ideal_p99`: a server with no overhead at all, answering each request after its pairs' compute
at that best rate, one request at a time in arrival order (for requests of equal size no order
has a shorter tail, and batching them gains nothing once the cost a pair is flat), under the
same Poisson arrivals. Its p99 is the floor of every server's at that rate on this core: with
`seconds` windows and `repeats`, read as the benchmark reads them (loadgen's p99 of each
window, median over repeats; the median over many simulated runs), and over a long run.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

from shapes import PASSAGES, QUERY, passages

LONG_RUN = 100_000
"""Requests in the long simulated run that gives the true p99."""
RUNS = 400
"""Simulated benchmark runs whose median gives the windowed p99."""


def ms_per_pair(
    folder: Path, sizes: tuple[int, ...] = (10, 20, 40), *, packed: bool = False
) -> dict[int, float]:
    """CPU ms a pair at each batch size, the model called directly on core 0 (`packed`: its
    linears by oneDNN-packed weights)."""
    import mkl_first  # noqa: F401  (before torch: MKL's kernels as the server runs them)
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from batchserve.models.linears import Products, pack_linears

    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
        if packed:
            pack_linears(torch, model, Products(torch, "cpu"))
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        pairs = [[QUERY, p] for k in range(max(sizes) // PASSAGES + 1) for p in passages(str(k))]
        result = {}
        for size in sizes:
            features = tokenizer(pairs[:size], padding=True, truncation=True, return_tensors="pt")
            with torch.inference_mode():
                model(**features)  # warm
                calls, began = 0, time.thread_time()
                while time.thread_time() - began < 3.0:
                    model(**features)
                    calls += 1
            result[size] = (time.thread_time() - began) / calls / size * 1e3
        return result
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)


def _latencies(rate: float, service_s: float, count: int, rng: random.Random) -> list[float]:
    """FIFO, one request at a time, each taking `service_s`: each one's latency."""
    arrival, free, latencies = 0.0, 0.0, []
    for _ in range(count):
        arrival += rng.expovariate(rate)
        free = max(free, arrival) + service_s
        latencies.append(free - arrival)
    return latencies


def _p99(latencies: list[float]) -> float:
    ranked = sorted(latencies)  # loadgen's: the value at int(n x 0.99)
    return ranked[min(len(ranked) - 1, int(len(ranked) * 0.99))]


def ideal_p99(rate: float, service_s: float, seconds: float, repeats: int) -> float:
    """The ideal server's p99 (ms) as the benchmark reads it: median over simulated runs of
    the median over `repeats` windows of `seconds`."""
    rng = random.Random(int(rate * 1000))
    count = max(1, round(rate * seconds))
    runs = [
        statistics.median(_p99(_latencies(rate, service_s, count, rng)) for _ in range(repeats))
        for _ in range(RUNS)
    ]
    return statistics.median(runs) * 1e3


def ideal_goal_rate(service_s: float, goal_ms: float) -> float:
    """The highest rate (to 0.05 rps) at which the ideal server's p99 over a long run is
    within `goal_ms`."""
    rng, rate = random.Random(0), 0.05
    while _p99(_latencies(rate + 0.05, service_s, LONG_RUN, rng)) * 1e3 <= goal_ms:
        rate += 0.05
    return round(rate, 2)


def describe(per_pair: dict[int, float]) -> str:
    return json.dumps({f"batch {size}": round(ms, 2) for size, ms in per_pair.items()})
