"""Virtual-time simulator: drives a batching policy against Poisson arrivals, no HTTP.

Compares policies in seconds of CPU time, before the HTTP sweep confirms them:

    python benchmarks/simulate.py --devices 4 --rates 50,200,3500
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import deque
from dataclasses import dataclass

from batchserve.config import Config
from batchserve.rules.capacity import CallTime
from batchserve.rules.policy import Policy, QueueView, make_policy

_ARRIVAL, _DONE, _WAKE = 0, 1, 2


@dataclass(frozen=True)
class SimResult:
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_batch: float
    answered: int
    offered: int


def simulate(
    config: Config,
    *,
    devices: int,
    rate: float,
    seconds: float,
    service_s: float = 0.1,
    jitter_s: float = 0.0,
    timeout_s: float = 5.0,
    seed: int = 1,
) -> SimResult:
    rng = random.Random(seed)
    call_time = CallTime()  # the engine's one batch-time estimate, fed as the pool feeds it
    policy: Policy = make_policy(config, call_time)
    events: list[tuple[float, int, int]] = []
    now = 0.0
    offered = 0
    while (now := now + rng.expovariate(rate)) < seconds:
        heapq.heappush(events, (now, _ARRIVAL, offered))
        offered += 1
    queue: deque[float] = deque()
    busy_since: dict[int, float] = {}
    batches: dict[int, list[float]] = {}
    latencies: list[float] = []
    batch_sizes: list[int] = []
    while events:
        now, kind, ident = heapq.heappop(events)
        if kind == _ARRIVAL:
            queue.append(now)
        elif kind == _DONE:
            started = busy_since.pop(ident)
            call_time.observe(now - started)
            latencies.extend(now - arrival for arrival in batches.pop(ident))
        while queue and queue[0] + timeout_s <= now:
            queue.popleft()
        while True:
            free = [device for device in range(devices) if device not in busy_since]
            view = QueueView(
                size=len(queue),
                oldest_arrival=queue[0] if queue else float("inf"),
                earliest_deadline=queue[0] + timeout_s if queue else float("inf"),
            )
            decision = policy.decide(now, view, len(free), list(busy_since.values()))
            if decision.dispatch == 0:
                if decision.wake_at is not None:
                    heapq.heappush(events, (decision.wake_at, _WAKE, 0))
                break
            device = free[0]
            busy_since[device] = now
            batches[device] = [queue.popleft() for _ in range(decision.dispatch)]
            batch_sizes.append(decision.dispatch)
            took = service_s + rng.uniform(0.0, jitter_s)
            heapq.heappush(events, (now + took, _DONE, device))
    latencies.sort()
    return SimResult(
        p50_ms=1e3 * latencies[len(latencies) // 2],
        p99_ms=1e3 * latencies[int(len(latencies) * 0.99)],
        max_ms=1e3 * latencies[-1],
        mean_batch=statistics.fmean(batch_sizes),
        answered=len(latencies),
        offered=offered,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="simulated devices (D)")
    parser.add_argument(
        "--rates", default="50,200,1000,3500", help="offered requests/s, comma-separated"
    )
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="arrivals over this long, virtual seconds"
    )
    parser.add_argument(
        "--jitter-ms", type=float, default=0.0, help="each call takes 100 ms + uniform(0, this)"
    )
    args = parser.parse_args()
    variants = {
        "adaptive": Config(),
        "greedy": Config(max_linger_ms=0),
        "fixed 32/50ms": Config(policy="fixed", max_batch_size=32),
    }
    print("| policy | D | rate | p50 ms | p99 ms | max ms | mean batch | answered |")
    print("|---|---|---|---|---|---|---|---|")
    for rate in (float(r) for r in args.rates.split(",")):
        for name, config in variants.items():
            r = simulate(
                config,
                devices=args.devices,
                rate=rate,
                seconds=args.seconds,
                jitter_s=args.jitter_ms / 1e3,
            )
            print(
                f"| {name} | {args.devices} | {rate:g} | {r.p50_ms:.0f} | {r.p99_ms:.0f} |"
                f" {r.max_ms:.0f} | {r.mean_batch:.1f} | {r.answered}/{r.offered} |"
            )


if __name__ == "__main__":
    main()
