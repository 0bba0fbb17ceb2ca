"""The front-end baseline: a bare aiohttp handler on uvloop, no batching and no backend.

It answers like the simulated model (the input reversed) so the load generator's checks hold;
its saturation is the ceiling for any server built on aiohttp on one core. With `--hold-ms`
each request waits that long before its answer, as it would for a batch call, so that as
many connections are open at once as a batching server keeps: the fair baseline for what
batchserve costs per request on top of aiohttp. With `--full-answer` it answers with
batchserve's fields and headers (request id, timings, Server-Timing, X-Request-Id): what
answering the same API costs with no batching behind it.

    taskset -c 0 python benchmarks/bare_server.py --port 8001 [--hold-ms 100] [--full-answer]
"""

from __future__ import annotations

import argparse
import asyncio
import os

import orjson
import uvloop
from aiohttp import web

HOLD_S = web.AppKey("hold_s", float)


async def inference(request: web.Request) -> web.Response:
    text = orjson.loads(await request.read())["input"]
    if hold_s := request.app[HOLD_S]:
        await asyncio.sleep(hold_s)
    return web.Response(body=orjson.dumps({"output": text[::-1], "batch_size": 1}),
                        content_type="application/json")  # fmt: skip


async def full_answer(request: web.Request) -> web.Response:
    """As `inference`, with batchserve's answer: the same fields, headers and id."""
    arrival = asyncio.get_running_loop().time()
    request_id = request.headers.get("X-Request-Id") or os.urandom(16).hex()
    text = orjson.loads(await request.read())["input"]
    await asyncio.sleep(request.app[HOLD_S])
    held_ms = round((asyncio.get_running_loop().time() - arrival) * 1e3, 3)
    body = {
        "output": text[::-1],
        "model": "default",
        "version": "1",
        "request_id": request_id,
        "latency_ms": held_ms,
        "queue_ms": 0.0,
        "compute_ms": held_ms,
        "batch_size": 1,
    }
    headers = {
        "Content-Type": "application/json",
        "X-Request-Id": request_id,
        "Server-Timing": f"queue;dur=0.000, compute;dur={held_ms:.3f}",
    }
    return web.Response(body=orjson.dumps(body), headers=headers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--hold-ms", type=float, default=0.0, help="wait this long per request")
    parser.add_argument(
        "--full-answer", action="store_true", help="answer with batchserve's fields and headers"
    )
    args = parser.parse_args()
    app = web.Application()
    app[HOLD_S] = args.hold_ms / 1e3
    app.router.add_post("/api/inference", full_answer if args.full_answer else inference)
    # Printed once listening (run_app prints then), as batchserve does: a benchmark waits for
    # this line, and must not load a stale server that still holds the port.
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=_listening,
                loop=uvloop.new_event_loop(), backlog=4096)  # fmt: skip


def _listening(message: str) -> None:
    print(f"bare server listening: {message.splitlines()[0]}", flush=True)


if __name__ == "__main__":
    main()
