"""The front-end baseline: a bare aiohttp handler on uvloop, no batching and no backend.

It answers like the simulated model (the input reversed) so the load generator's checks hold;
its saturation is the ceiling for any server built on aiohttp on one core. With `--hold-ms`
each request waits that long before its answer, as it would for a batch call, so that as
many connections are open at once as a batching server keeps: the fair baseline for what
batchserve costs per request on top of aiohttp. With `--full-answer` it answers with
batchserve's fields and headers (request id, timings, Server-Timing, X-Request-Id): what
answering the same API costs with no batching behind it. With `--batched N` as well, the
requests waiting go together to the first free of N device threads, each holding a batch
`--hold-ms`: the least any batching server on aiohttp does (a future a request, a thread
hand-off a batch), with none of batchserve's deadlines, checks, fairness or metrics.

    taskset -c 0 python benchmarks/bare_server.py --port 8001 [--hold-ms 100] [--full-answer]
        [--batched 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import threading
import time
from collections.abc import AsyncIterator

import orjson
import uvloop
from aiohttp import web

HOLD_S = web.AppKey("hold_s", float)
Waiting = tuple[str, "asyncio.Future[tuple[str, int]]"]
"""A request's input, and the future its handler awaits: (output, batch size)."""


class DeviceThreads:
    """Batches with nothing else: what waits goes to the first free thread, which holds it
    `hold_s` (a device call) and hands the outputs back to the loop in one callback."""

    def __init__(self, devices: int, hold_s: float) -> None:
        self._devices, self._hold_s = devices, hold_s
        self._waiting: list[Waiting] = []
        self._free: list[queue.SimpleQueue[list[Waiting]]] = []
        """Each free thread's job queue."""

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        for _ in range(self._devices):
            jobs: queue.SimpleQueue[list[Waiting]] = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(loop, jobs), daemon=True).start()
            self._free.append(jobs)
        yield

    async def run(self, text: str) -> tuple[str, int]:
        """The output and the batch's size."""
        future: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
        self._waiting.append((text, future))
        self._send()
        return await future

    def _send(self) -> None:
        if self._waiting and self._free:
            batch, self._waiting = self._waiting, []
            self._free.pop().put(batch)

    def _work(
        self, loop: asyncio.AbstractEventLoop, jobs: queue.SimpleQueue[list[Waiting]]
    ) -> None:
        while True:
            batch = jobs.get()
            time.sleep(self._hold_s)
            outputs = [text[::-1] for text, _ in batch]
            loop.call_soon_threadsafe(self._done, jobs, batch, outputs)

    def _done(
        self, jobs: queue.SimpleQueue[list[Waiting]], batch: list[Waiting], outputs: list[str]
    ) -> None:
        for (_, future), output in zip(batch, outputs, strict=True):
            if not future.done():  # its handler was cancelled
                future.set_result((output, len(batch)))
        self._free.append(jobs)
        self._send()


DEVICE_THREADS = web.AppKey("device_threads", DeviceThreads)


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
    if (devices := request.app.get(DEVICE_THREADS)) is not None:
        output, batch_size = await devices.run(text)
    else:
        await asyncio.sleep(request.app[HOLD_S])
        output, batch_size = text[::-1], 1
    held_ms = round((asyncio.get_running_loop().time() - arrival) * 1e3, 3)
    body = {
        "output": output,
        "model": "default",
        "version": "1",
        "request_id": request_id,
        "latency_ms": held_ms,
        "queue_ms": 0.0,
        "compute_ms": held_ms,
        "batch_size": batch_size,
    }
    headers = {
        "Content-Type": "application/json",
        "X-Request-Id": request_id,
        "Server-Timing": f"queue;dur=0.000, compute;dur={held_ms:.3f}",
    }
    return web.Response(body=orjson.dumps(body), headers=headers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001, help="port to listen on, at 127.0.0.1")
    parser.add_argument("--hold-ms", type=float, default=0.0, help="wait this long per request")
    parser.add_argument(
        "--full-answer", action="store_true", help="answer with batchserve's fields and headers"
    )
    parser.add_argument(
        "--batched", type=int, metavar="N",
        help="with --full-answer: batch over N device threads, each holding a batch --hold-ms",
    )  # fmt: skip
    args = parser.parse_args()
    if args.batched is not None and (not args.full_answer or args.batched < 1):
        parser.error("--batched needs --full-answer and at least 1 device")
    app = web.Application()
    app[HOLD_S] = args.hold_ms / 1e3
    if args.batched:
        app[DEVICE_THREADS] = devices = DeviceThreads(args.batched, args.hold_ms / 1e3)
        app.cleanup_ctx.append(devices.lifespan)
    app.router.add_post("/api/inference", full_answer if args.full_answer else inference)
    # Printed once listening (run_app prints then), as batchserve does: a benchmark waits for
    # this line, and must not load a stale server that still holds the port.
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=_listening,
                loop=uvloop.new_event_loop(), backlog=4096)  # fmt: skip


def _listening(message: str) -> None:
    print(f"bare server listening: {message.splitlines()[0]}", flush=True)


if __name__ == "__main__":
    main()
