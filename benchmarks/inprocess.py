"""Server CPU per answer with aiohttp's HTTP protocol fed in process: no sockets, no kernel.

Each server runs in a process of its own on core 0, with its clients inside it: every
10 ms a tick writes `--rate` / 100 raw HTTP requests into the server's protocol objects
through in-memory transports, and the answers come back the same way. What a process
spends is then the server's Python (parsing, handler, answer) and the clients' few
writes, the same for every server, with none of the system calls that make most of
overhead.py's numbers and most of its noise. All servers run at once, so that they share
the same seconds of this machine's drifting speed; each repeat gives each one's CPU per
answer as a ratio to the bare handler's (`bare_server.py --hold-ms 100`). The ratios are
larger than overhead.py's, since the kernel's share, the same for every server, is left
out: use this to tell apart two versions of the request path (`--tree`, a checkout that
has `batchserve.cli.tune_for_serving`, from 2026-11-24 on), overhead.py for the target.

    python benchmarks/inprocess.py                          # bare and batchserve, 1 min
    python benchmarks/inprocess.py --tree before=/tmp/base  # and batchserve of another tree
    python benchmarks/inprocess.py --traced                 # and batchserve with --trace on

`--traced` adds this tree's batchserve with tracing on, its spans batched by the SDK's
BatchSpanProcessor to an exporter that drops them: the spans' cost on the loop and on the
processor's thread, without OTLP's encoding and sending (needs the [otel] extra).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from progress import Progress
from servers import ROOT

TICK_S = 0.01
WARM_UP_S = 2.0


class Transport(asyncio.Transport):
    """One client connection, in memory: what the server writes goes to `client.got`."""

    def __init__(self, client: Client) -> None:
        super().__init__()
        self._client = client
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._client.got(bytes(data))

    def writelines(self, chunks: Any) -> None:
        self._client.got(b"".join(chunks))

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


class Client:
    """A keep-alive connection that sends a request when asked and counts the 200s."""

    def __init__(self, protocol: Any, idle: list[Client], answered: list[int]) -> None:
        self._protocol, self._idle, self._answered = protocol, idle, answered
        protocol.connection_made(Transport(self))

    def send(self, number: int) -> None:
        body = b'{"input": "request number %d"}' % number
        self._protocol.data_received(
            b"POST /api/inference HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )

    def got(self, data: bytes) -> None:
        if data.startswith(b"HTTP/1.1 "):  # a response starts (its body may follow apart)
            if not data.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"answered {data[:200]!r}")
            self._answered[0] += 1
            self._idle.append(self)

    def close(self) -> None:
        self._protocol.connection_lost(None)


async def _runner(kind: str, tree: str) -> Any:
    """The aiohttp runner of the server to measure, set up as its command line would."""
    from aiohttp import web

    if kind == "bare":
        spec = importlib.util.spec_from_file_location("bare", ROOT / "benchmarks/bare_server.py")
        assert spec is not None
        assert spec.loader is not None
        bare = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bare)
        app = web.Application()
        app[bare.HOLD_S] = 0.1
        app.router.add_post("/api/inference", bare.inference)
        return web.AppRunner(app, access_log=None)
    sys.path.insert(0, tree)
    from batchserve import Engine
    from batchserve.cli import config_from_args, tune_for_serving
    from batchserve.server import AppRunner, create_app

    traced = ["--trace", "on"] if kind == "traced" else []
    config, _ = config_from_args(["--devices", "sim:4", "--metrics", "on", *traced])
    tune_for_serving()
    engine = Engine(config, tracer_provider=_dropping_provider()) if traced else Engine(config)
    return AppRunner(create_app(engine), handler_cancellation=True, access_log=None)


def _dropping_provider() -> Any:
    """An SDK TracerProvider whose batches of spans go to an exporter that drops them."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropped(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    return provider


async def _measure(kind: str, tree: str, rate: float, seconds: float) -> dict[str, float]:
    """One server's CPU per answer under `rate` requests a second, after a warm-up."""
    runner = await _runner(kind, tree)
    await runner.setup()
    assert runner.server is not None
    loop = asyncio.get_running_loop()
    idle: list[Client] = []
    clients: list[Client] = []
    answered = [0]
    sent = 0
    carry = 0.0

    def tick() -> None:
        nonlocal sent, carry
        carry += rate * TICK_S
        while carry >= 1:
            carry -= 1
            if not idle:
                clients.append(Client(runner.server(), idle, answered))
                idle.append(clients[-1])
            idle.pop().send(sent)
            sent += 1

    ticks = Ticks(loop, tick)
    await asyncio.sleep(WARM_UP_S)
    answers, cpu = answered[0], time.process_time()
    await asyncio.sleep(seconds)
    answers, cpu = answered[0] - answers, time.process_time() - cpu
    ticks.stop()
    await asyncio.sleep(0.5)  # the last answers
    for client in clients:
        client.close()
    await runner.cleanup()
    return {"us_per_answer": 1e6 * cpu / answers, "answered_rps": answers / seconds}


class Ticks:
    """Calls `tick` every TICK_S on the loop's clock, on schedule whatever each call takes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick: Any) -> None:
        self._loop, self._tick = loop, tick
        self._next = loop.time()
        self._handle = loop.call_at(self._next, self._fire)

    def _fire(self) -> None:
        self._tick()
        self._next += TICK_S
        self._handle = self._loop.call_at(self._next, self._fire)

    def stop(self) -> None:
        self._handle.cancel()


def _child(kind: str, tree: str, rate: float, seconds: float) -> None:
    import uvloop

    print(json.dumps(uvloop.run(_measure(kind, tree, rate, seconds))), flush=True)


def _start(kind: str, tree: str, rate: float, seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, str(Path(__file__).resolve()), "--child", kind,
         tree, "--rate", str(rate), "--seconds", str(seconds)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=3000.0, help="requests/s per server")
    parser.add_argument("--seconds", type=float, default=6.0, help="each run's measured time")
    parser.add_argument("--repeats", type=int, default=6, help="runs (medians over them)")
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=DIR",
        help="also batchserve as checked out in DIR (e.g. a git worktree of another commit,"
        " one with batchserve.cli.tune_for_serving) under NAME; repeat for more",
    )  # fmt: skip
    parser.add_argument(
        "--traced", action="store_true",
        help="also this tree's batchserve with --trace on, its spans dropped by the exporter",
    )  # fmt: skip
    parser.add_argument("--child", nargs=2, metavar=("KIND", "TREE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child, args.rate, args.seconds)
        return
    if args.rate < 100 or args.seconds <= 0 or args.repeats < 1:
        parser.error("--rate must be at least 100, --seconds above 0, --repeats at least 1")
    servers = {"bare": ("bare", ""), "batchserve": ("batchserve", str(ROOT))}
    for named in args.tree:
        name, _, tree = named.partition("=")
        cli = Path(tree) / "batchserve/cli.py"
        if not name or name in servers or "def tune_for_serving" not in _text(cli):
            parser.error(
                f"--tree {named}: give a new NAME=DIR, DIR a checkout of batchserve that has"
                " cli.tune_for_serving (serve's process settings, which each server here takes)"
            )
        servers[name] = ("batchserve", tree)
    if args.traced:
        servers["traced"] = ("traced", str(ROOT))
    ratios: dict[str, list[float]] = {name: [] for name in servers}
    costs: dict[str, list[float]] = {name: [] for name in servers}
    progress = Progress(args.repeats)
    for _ in range(args.repeats):
        children = {
            name: _start(kind, tree, args.rate, args.seconds)
            for name, (kind, tree) in servers.items()
        }
        measured = {}
        for name, child in children.items():
            out, _ = child.communicate(timeout=args.seconds + 120)
            if child.returncode:
                raise RuntimeError(f"{name} failed")
            measured[name] = json.loads(out)
        for name, numbers in measured.items():
            costs[name].append(numbers["us_per_answer"])
            ratios[name].append(numbers["us_per_answer"] / measured["bare"]["us_per_answer"])
        progress.step(
            ", ".join(f"{name}: {ratios[name][-1]:.3f}" for name in servers if name != "bare")
        )
    print(f"in process, {args.rate:g} rps each, all at once, {args.repeats} repeats;"
          " median us of CPU per answer and median of the repeats' ratios to bare:")  # fmt: skip
    for name in servers:
        each = ", ".join(f"{ratio:.3f}" for ratio in ratios[name])
        print(f"  {name}: {statistics.median(costs[name]):.1f} us,"
              f" {statistics.median(ratios[name]):.3f} x bare ({each})")  # fmt: skip


if __name__ == "__main__":
    main()
