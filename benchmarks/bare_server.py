"""The front-end baseline: a bare aiohttp handler on uvloop, no batching and no backend.

It answers like the simulated model (the input reversed) so the load generator's checks hold;
its saturation is the ceiling for any server built on aiohttp on one core. With `--hold-ms`
each request waits that long before its answer, as it would for a batch call, so that as
many connections are open at once as a batching server keeps: the fair baseline for what
batchserve costs per request on top of aiohttp.

    taskset -c 0 python benchmarks/bare_server.py --port 8001 [--hold-ms 100]
"""

from __future__ import annotations

import argparse
import asyncio

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--hold-ms", type=float, default=0.0, help="wait this long per request")
    args = parser.parse_args()
    app = web.Application()
    app[HOLD_S] = args.hold_ms / 1e3
    app.router.add_post("/api/inference", inference)
    print(f"bare server on http://127.0.0.1:{args.port}", flush=True)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None,
                loop=uvloop.new_event_loop(), backlog=4096)  # fmt: skip


if __name__ == "__main__":
    main()
