"""What one /metrics scrape costs in process: the handler called directly, no sockets.

A server with 4 simulated devices (100 ms calls) and three model versions, set for serving
as `serve` sets it, takes `--rate` requests a second over HTTP from a client in the same
process (answers and a few errors, spread over the versions, so that the series are the
realistic ones and the busy ones change between scrapes), and its /metrics handler is
called every 50 ms, as the inference gateway's picker scrapes, each call timed alone (the
loop thread's CPU time). The median of `--repeats` runs of `--scrapes` scrapes, in ms a
scrape. `--profile` prints cProfile's top entries over one run instead. scrape_cost.py
measures the whole cost from outside, aiohttp's request handling included.

The server runs with `--max-age-ms` as its --metrics-max-age-ms (default: the server's, 500):
at 50 ms apart, one scrape in about ten renders everything and the others reuse that render
but for the picker's gauges, so the mean is what a picker at 20/s costs. `--max-age-ms 0`
renders everything at every scrape (as before the setting existed).

    python benchmarks/scrape_micro.py                    # about 40 s
    python benchmarks/scrape_micro.py --max-age-ms 0     # every scrape a full render
    python benchmarks/scrape_micro.py --path /metrics/picker  # the picker's gauges alone
    python benchmarks/scrape_micro.py --profile
    python benchmarks/scrape_micro.py --gap-s 0          # back to back, as a tight loop measures
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchserve.cli import tune_for_serving  # noqa: E402
from batchserve.config import Config  # noqa: E402
from batchserve.engine.core import Engine  # noqa: E402
from batchserve.server import create_app  # noqa: E402

MODELS = """
[[model]]
name = "a"
version = "1"
devices = "sim:4"

[[model]]
name = "a"
version = "2"
devices = "sim:4"

[[model]]
name = "b"
version = "1"
devices = "sim:4"
"""
TICK_S = 0.01
BODIES = [
    *({"input": "x", "model": model, "version": version}
      for model, version in (("a", "1"), ("a", "2"), ("b", "1"))),
]  # fmt: skip
ODD = [{"input": "x", "model": "nope"}, {"inputs": 3}]


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        models = Path(folder) / "models.toml"
        models.write_text(MODELS)
        config = Config(models=str(models), metrics_max_age_ms=args.max_age_ms)
        app = create_app(Engine(config))
        async with TestClient(TestServer(app)) as client:
            sent = itertools.count()

            async def one() -> None:
                n = next(sent)
                body = ODD[n % 2] if n % 200 == 0 else BODIES[n % len(BODIES)]
                async with client.post("/api/inference", json=body) as answer:
                    await answer.read()

            requests: set[asyncio.Task[None]] = set()

            async def load() -> None:
                per_tick = round(args.rate * TICK_S)
                while True:  # bounded by its caller, which cancels it
                    for _ in range(per_tick):
                        task = asyncio.create_task(one())
                        requests.add(task)
                        task.add_done_callback(requests.discard)
                    await asyncio.sleep(TICK_S)

            loader = asyncio.create_task(load())
            try:
                await asyncio.sleep(3.0)  # every series made, the busy windows full
                tune_for_serving()
                await measure(app, args)
            finally:
                loader.cancel()
                await asyncio.gather(loader, *requests, return_exceptions=True)
            print(f"{next(sent)} requests sent", file=sys.stderr)


async def measure(app: object, args: argparse.Namespace) -> None:
    scrape = next(
        route.handler
        for route in app.router.routes()  # type: ignore[attr-defined]
        if route.method == "GET" and route.resource is not None
        and route.resource.canonical == args.path
    )  # fmt: skip
    request = make_mocked_request("GET", args.path, app=app)  # type: ignore[arg-type]
    body = (await scrape(request)).body
    print(f"{len(body.splitlines())} lines, {len(body)} bytes a scrape", file=sys.stderr)
    profile = cProfile.Profile() if args.profile else None
    runs = []
    for _ in range(1 if profile else args.repeats):
        spent = 0.0
        for _ in range(args.scrapes):
            await asyncio.sleep(args.gap_s)
            if profile:
                profile.enable()
            started = time.thread_time()
            await scrape(request)
            spent += time.thread_time() - started
            if profile:
                profile.disable()
        runs.append(spent / args.scrapes * 1e3)
        print(f"ms a scrape: {runs[-1]:.3f}", file=sys.stderr)
    if profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return
    print(
        f"ms a scrape: median {statistics.median(runs):.3f} of {len(runs)} runs"
        f" ({args.path}, --metrics-max-age-ms {args.max_age_ms:g}, {args.gap_s * 1e3:g} ms apart)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="requests a second")
    parser.add_argument("--scrapes", type=int, default=200, help="scrapes a run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of --scrapes scrapes (median)")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile's top entries over one run, not timings"
    )
    parser.add_argument("--path", default="/metrics", help="/metrics or /metrics/picker")
    parser.add_argument(
        "--max-age-ms", type=float, default=Config().metrics_max_age_ms,
        help="the server's --metrics-max-age-ms; 0: every scrape renders everything",
    )  # fmt: skip
    parser.add_argument(
        "--gap-s", type=float, default=0.05,
        help="between scrapes; 0: back to back (warm caches, the loop barely serving)",
    )  # fmt: skip
    asyncio.run(main(parser.parse_args()))
