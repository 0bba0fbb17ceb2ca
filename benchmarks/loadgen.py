"""Open-loop load generator: Poisson arrivals on a fixed schedule, latency from schedule.

Each request is sent at its scheduled time whatever the server is doing (open loop), and its
latency is counted from that scheduled time, so a slow server cannot hide its queueing by
slowing the sender. Every 200 answer is checked against its own input (the simulated model
reverses it). For chaos runs, `--poison-rate` marks that share of inputs with the simulated
backend's poison marker (they must come back 500, and are left out of the latency figures),
and `--hang-at-s` puts its hang marker in the first input sent after that time.
A lean HTTP/1.1 keep-alive client driven by protocol callbacks, with no task per request,
keeps the sender on its schedule at the rates the sweep offers (see `Run`).

    taskset -c 1 python benchmarks/loadgen.py --url http://127.0.0.1:8000 --rate 500
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import re
import sys
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import cast
from urllib.parse import urlsplit

import orjson
import uvloop
from shapes import SHAPES


@dataclass
class Summary:
    rate: float
    seconds: float
    sent: int
    ok: int
    success: float
    """200 answers over requests sent without the poison marker."""
    poison_sent: int
    poison_500: int
    leaked: int
    """Error answers (any status but 200) that name another request's input."""
    statuses: dict[str, int]
    wrong_output: int
    unanswered: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    last_third_p99_ms: float
    """The p99 of the requests due in the run's last third: whether it is back to normal
    after a fault earlier in the run."""
    max_ms: float
    good_share: float
    """Timed requests (after warm-up, without the poison marker) answered 200 within
    --good-ms, over all of them sent: shed, failed and lost requests count as misses."""
    achieved_rps: float
    """200 answers over the time from the first send to the last answer."""
    mean_batch: float
    batch_sizes: dict[str, int]
    """How many timed 200 answers came from a batch of each size."""
    compute_p50_ms: float
    by_key: dict[str, dict[str, object]]
    """With --keys: sent, success, p50/p99 (200s) and statuses for each named key."""


class Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time; its run hears each answer."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.current: Pending | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def send(self, pending: Pending, request: bytes) -> None:
        assert self.transport is not None
        self.current = pending
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = bytes(self.buffer[:head_end]).lower()
        start = head.find(b"content-length:")
        length = int(head[start + 15 : head.find(b"\r\n", start)]) if start >= 0 else 0
        if len(self.buffer) < head_end + 4 + length:
            return
        status = int(head[9:12])
        body = bytes(self.buffer[head_end + 4 : head_end + 4 + length])
        del self.buffer[: head_end + 4 + length]
        pending, self.current = self.current, None
        if pending is not None:
            self.run.answered(self, pending, status, body)

    def connection_lost(self, exc: Exception | None) -> None:
        pending, self.current = self.current, None
        self.run.dropped(self, pending)


@dataclass(slots=True)
class Pending:
    """A request from the moment it is due until its answer, or its loss, is counted."""

    index: int
    scheduled: float
    text: str
    name: str
    timeout: asyncio.TimerHandle | None = None


POISON_MARKER = "!poison!"
HANG_MARKER = "!hang!"
_INPUT = re.compile(r"req-\d+-\d+-[a-h]*")
"""An input `plain_input` made, as it may appear in an error's text."""


@dataclass(frozen=True)
class Workload:
    """What each scheduled request sends: its input and the key it sends it with."""

    texts: list[str]
    poisoned: set[int]
    """Indexes of the inputs that carry the poison marker."""
    key_names: list[str]
    """The class each request draws (an API key, a model or a length), by index; empty when
    the run uses none. Latencies are also reported per class."""
    key_headers: dict[str, bytes]
    model_field: bool = False
    """Whether the class is a model, sent as the body's "model"."""
    shape: str = "inference"
    """The route and body (shapes.py)."""


class Run:
    """Sends each request when it is due and counts each answer as it arrives.

    Everything happens in protocol callbacks and timers, with no task or coroutine per
    request: a task per request (and asyncio.wait_for, which adds another) cost ~150 us of
    this core each, so at 8,000 requests a second the sender fell behind its own schedule.
    At most `limit` connections are open; a request due while all are busy waits for one,
    and that wait counts in its latency.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, url: str, limit: int, timeout_s: float,
                 warmup_s: float, good_s: float, workload: Workload) -> None:  # fmt: skip
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.loop, self.limit, self.timeout_s = loop, limit, timeout_s
        self.warmup_s, self.good_s = warmup_s, good_s
        self.good = 0
        """Timed 200 answers within good_s of their scheduled time."""
        self.workload = workload
        host, path = self.host.encode(), SHAPES[workload.shape].path.encode()
        self.heads = {
            name: b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
            b"%b" % (path, host, header)
            for name, header in {"": b"", **workload.key_headers}.items()
        }
        """Each request's bytes up to its Content-Length, by key name ("" for none)."""
        self.idle: list[Connection] = []
        self.opened = 0
        """Connections open or opening."""
        self.queued: deque[Pending] = deque()
        self.openings: set[asyncio.Task[None]] = set()
        self.unfinished = len(workload.texts)
        self.finished: asyncio.Future[None] = loop.create_future()
        if not self.unfinished:
            self.finished.set_result(None)
        self.start = 0.0
        self.per_key: dict[str, tuple[Counter[str], list[float]]] = {
            name: (Counter(), []) for name in workload.key_headers
        }
        self.latencies: list[float] = []
        self.scheduled_at: list[float] = []
        """Beside each latency, when its request was due (seconds into the run)."""
        self.statuses: Counter[str] = Counter()
        self.batch_sizes: list[int] = []
        self.computes: list[float] = []
        self.last_answer = 0.0
        self.wrong = 0
        self.leaked = 0
        """Error answers whose text names another request's input."""
        self.poison_500 = 0

    async def open(self) -> Connection:
        _, conn = await self.loop.create_connection(lambda: Connection(self), self.host, self.port)
        return conn

    async def warm(self, count: int) -> None:
        self.opened += count
        self.idle = list(await asyncio.gather(*(self.open() for _ in range(count))))

    def due(self, index: int, scheduled: float) -> None:
        names = self.workload.key_names
        pending = Pending(
            index, scheduled, self.workload.texts[index], names[index] if names else ""
        )
        if self.idle:
            self.write(self.idle.pop(), pending)
        elif self.opened < self.limit:
            self.open_for(pending)
        else:
            self.queued.append(pending)

    def open_for(self, pending: Pending) -> None:
        self.opened += 1
        task = self.loop.create_task(self._open_for(pending))
        self.openings.add(task)
        task.add_done_callback(self.openings.discard)

    async def _open_for(self, pending: Pending) -> None:
        try:
            conn = await self.open()
        except OSError:
            self.opened -= 1
            self.count_lost(pending)
            return
        self.write(conn, pending)

    def write(self, conn: Connection, pending: Pending) -> None:
        assert conn.transport is not None
        pending.timeout = self.loop.call_later(self.timeout_s, conn.transport.close)
        body = SHAPES[self.workload.shape].body(pending.text)
        if self.workload.model_field:
            body["model"] = pending.name
        payload = orjson.dumps(body)
        conn.send(
            pending,
            b"%bContent-Length: %d\r\n\r\n%b" % (self.heads[pending.name], len(payload), payload),
        )

    def answered(self, conn: Connection, pending: Pending, status: int, body: bytes) -> None:
        if pending.timeout is not None:
            pending.timeout.cancel()
        self.count_answer(pending, status, body)
        if self.queued:
            self.write(conn, self.queued.popleft())
        else:
            self.idle.append(conn)
        self.count_finished()

    def dropped(self, conn: Connection, pending: Pending | None) -> None:
        """A connection closed: by the server, or by a request's timeout."""
        self.opened -= 1
        if conn in self.idle:
            self.idle.remove(conn)
        if pending is not None:
            if pending.timeout is not None:
                pending.timeout.cancel()
            self.count_lost(pending)
        if self.queued and self.opened < self.limit:
            self.open_for(self.queued.popleft())

    def count_lost(self, pending: Pending) -> None:
        self.statuses["lost"] += 1
        if pending.name:
            self.per_key[pending.name][0]["lost"] += 1
        self.count_finished()

    def count_finished(self) -> None:
        self.unfinished -= 1
        if not self.unfinished and not self.finished.done():
            self.finished.set_result(None)

    def count_answer(self, pending: Pending, status: int, body: bytes) -> None:
        now = self.loop.time()
        self.last_answer = now
        if status != 200:
            own = pending.text.split("!", 1)[0]
            self.leaked += any(found != own for found in _INPUT.findall(body.decode()))
        if pending.index in self.workload.poisoned:
            self.poison_500 += status == 500
            return
        name = pending.name
        self.statuses[str(status)] += 1
        if name:
            self.per_key[name][0][str(status)] += 1
        if status != 200:
            return
        answer = orjson.loads(body)
        if not SHAPES[self.workload.shape].check(answer, pending.text):
            self.wrong += 1
        if pending.scheduled - self.start >= self.warmup_s:
            latency = now - pending.scheduled
            self.latencies.append(latency)
            self.scheduled_at.append(pending.scheduled - self.start)
            self.good += latency <= self.good_s
            if name:
                self.per_key[name][1].append(latency)
            if isinstance(answer, dict) and "batch_size" in answer:  # /api/inference's
                self.batch_sizes.append(answer["batch_size"])
                self.computes.append(answer.get("compute_ms", 0.0))


LENGTHS = [("short", (8, 32), 0.80), ("medium", (100, 300), 0.15), ("long", (800, 1500), 0.05)]
"""--length-mix: most inputs short, a long tail (characters, drawn uniformly in each range)."""


def plain_input(seed: int, index: int) -> str:
    """The `index`th input a run of `seed` sends: unique, so that every answer can be
    checked against its own input, and of a few lengths. Benchmarks that call a model
    directly use these too, so that both sides compute over the same tokens."""
    return f"req-{seed}-{index}-" + "abcdefgh"[: index % 9]


def _sized(text: str, length: int) -> str:
    return (text + "." * length)[: max(length, len(text))]


async def run(url: str, rate: float, seconds: float, warmup_s: float, good_s: float, seed: int,
              connections: int, timeout_s: float, poison_rate: float = 0.0,
              hang_at_s: float | None = None,
              keys: list[tuple[str, str, float]] | None = None,
              models: list[tuple[str, float]] | None = None,
              length_mix: bool = False, repeat_poison: int = 0,
              poison_key: str = "", shape: str = "inference") -> Summary:  # fmt: skip
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    schedule: list[float] = []
    clock = 0.0
    while (clock := clock + rng.expovariate(rate)) < seconds:
        schedule.append(clock)
    poisoned = {index for index in range(len(schedule)) if rng.random() < poison_rate}
    # One poison input sent again and again, evenly spread: a client's retry loop.
    step = max(1, len(schedule) // repeat_poison) if repeat_poison else 0
    repeated = set(range(0, len(schedule), step)[:repeat_poison]) if step else set()
    poisoned |= repeated
    names = [name for name, _, _ in keys or []]
    key_names = rng.choices(names, [w for _, _, w in keys], k=len(schedule)) if keys else []
    if poison_key:  # only that key's requests carry poison: a share of its own
        poisoned = {index for index in poisoned if key_names[index] == poison_key}
    hang_index = next(
        (index for index, at in enumerate(schedule) if hang_at_s is not None and at >= hang_at_s),
        None,
    )
    texts = [
        ("the-same-bad-input" if index in repeated else plain_input(seed, index))
        + (POISON_MARKER if index in poisoned else "")
        + (HANG_MARKER if index == hang_index else "")
        for index in range(len(schedule))
    ]
    key_headers = {
        name: b"Authorization: Bearer %b\r\n" % key.encode() for name, key, _ in keys or []
    }
    if models:
        key_names = rng.choices([m for m, _ in models], [w for _, w in models], k=len(schedule))
        key_headers = {name: b"" for name, _ in models}
        # Each input names its model, so a backend can check no call mixed models.
        texts = [f"{name}|{text}" for name, text in zip(key_names, texts, strict=True)]
    if length_mix:
        key_names = rng.choices([c for c, _, _ in LENGTHS], [w for _, _, w in LENGTHS],
                                k=len(schedule))  # fmt: skip
        sizes = {name: size for name, size, _ in LENGTHS}
        texts = [_sized(text, rng.randint(*sizes[name]))
                 for text, name in zip(texts, key_names, strict=True)]  # fmt: skip
        key_headers = {name: b"" for name, _, _ in LENGTHS}
    workload = Workload(texts, poisoned, key_names, key_headers, bool(models), shape)
    load = Run(loop, url, connections, timeout_s, warmup_s, good_s, workload)
    await load.warm(min(connections, max(8, int(rate * 0.3))))
    load.start = start = loop.time() + 0.05
    # The cyclic GC stops this loop for milliseconds at a time, and every request due then
    # is sent late and timed from its schedule, so the pause would count against the server
    # (a handler that only sleeps 100 ms measured p99 185 ms at 3,000 rps with it, 111 ms
    # without). A run is bounded, so its few cycles can wait until the end.
    gc.disable()
    try:
        for index, offset in enumerate(schedule):
            scheduled = start + offset
            delay = scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            load.due(index, scheduled)
        await load.finished
    finally:
        gc.enable()
    late = sorted(lat for at, lat in zip(load.scheduled_at, load.latencies, strict=True)
                  if at >= seconds * 2 / 3)  # fmt: skip
    latencies = sorted(load.latencies)

    def pct(q: float, values: list[float] = latencies) -> float:
        if not values:
            return float("nan")
        return 1e3 * values[min(len(values) - 1, int(len(values) * q))]

    by_key: dict[str, dict[str, object]] = {}
    for name, (counts, times) in load.per_key.items():
        times.sort()
        sent = sum(counts.values())
        by_key[name] = {"sent": sent, "success": counts["200"] / sent if sent else 0.0,
                        "p50_ms": pct(0.5, times), "p99_ms": pct(0.99, times),
                        "statuses": dict(counts)}  # fmt: skip

    statuses = load.statuses
    ok = statuses["200"]
    clean = len(schedule) - len(poisoned)
    timed = sum(1 for index, at in enumerate(schedule) if at >= warmup_s and index not in poisoned)
    computes = sorted(load.computes)
    batch_sizes = load.batch_sizes
    return Summary(
        rate=rate,
        seconds=seconds,
        sent=len(schedule),
        ok=ok,
        success=ok / clean if clean else 0.0,
        poison_sent=len(poisoned),
        poison_500=load.poison_500,
        statuses=dict(statuses),
        wrong_output=load.wrong,
        leaked=load.leaked,
        unanswered=statuses["lost"],
        p50_ms=pct(0.50),
        p90_ms=pct(0.90),
        p99_ms=pct(0.99),
        last_third_p99_ms=pct(0.99, late),
        max_ms=1e3 * latencies[-1] if latencies else float("nan"),
        good_share=load.good / timed if timed else 0.0,
        achieved_rps=ok / (load.last_answer - start) if load.last_answer > start else 0.0,
        mean_batch=sum(batch_sizes) / len(batch_sizes) if batch_sizes else 0.0,
        batch_sizes={str(size): n for size, n in sorted(Counter(batch_sizes).items())},
        compute_p50_ms=computes[len(computes) // 2] if computes else float("nan"),
        by_key=by_key,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the server: its host and port (the route is --shape's)",
    )
    parser.add_argument("--rate", type=float, required=True, help="offered requests per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the schedule")
    parser.add_argument(
        "--warmup-s", type=float, default=1.0, help="arrivals this early are checked, not timed"
    )
    parser.add_argument(
        "--good-ms", type=float, default=200.0, help="an answer this fast counts in good_share"
    )
    parser.add_argument("--seed", type=int, default=1, help="seeds the arrivals and inputs")
    parser.add_argument("--connections", type=int, default=4000, help="at most this many open")
    parser.add_argument(
        "--timeout-s", type=float, default=15.0, help="a request unanswered this long is lost"
    )
    parser.add_argument(
        "--poison-rate", type=float, default=0.0, help="share of inputs with the poison marker"
    )
    parser.add_argument(
        "--hang-at-s", type=float, default=None, help="send the hang marker at this time"
    )
    parser.add_argument(
        "--poison-key",
        default="",
        help="with --keys: only this key's requests carry poison (--poison-rate of its own)",
    )
    parser.add_argument(
        "--repeat-poison",
        type=int,
        default=0,
        help="send one and the same poison input this many times, spread over the run",
    )
    parser.add_argument(
        "--models", default="", help="models to mix, name:weight,...; sent as the body's model"
    )
    parser.add_argument(
        "--length-mix", action="store_true", help="inputs of realistic lengths (see LENGTHS)"
    )
    parser.add_argument(
        "--keys",
        default="",
        help="API keys to mix, name=key:weight,...; each request draws one by weight",
    )
    parser.add_argument(
        "--shape", default="inference", choices=sorted(SHAPES),
        help="the route and body sent (shapes.py): the batch route, or a retrieval route",
    )  # fmt: skip
    args = parser.parse_args()
    if args.seconds <= args.warmup_s:
        parser.error(
            f"--seconds must exceed --warmup-s ({args.warmup_s:g}): nothing would be timed"
        )
    keys = [
        (name, key, float(weight))
        for name, rest in (part.split("=", 1) for part in args.keys.split(",") if part)
        for key, weight in [rest.rsplit(":", 1)]
    ]
    models = [(name, float(weight)) for name, weight in
              (part.rsplit(":", 1) for part in args.models.split(",") if part)]  # fmt: skip
    summary = uvloop.run(
        run(args.url, args.rate, args.seconds, args.warmup_s, args.good_ms / 1e3, args.seed,
            args.connections,
            args.timeout_s, args.poison_rate, args.hang_at_s, keys or None, models or None,
            args.length_mix, args.repeat_poison, args.poison_key, args.shape)
    )  # fmt: skip
    sys.stdout.write(orjson.dumps(asdict(summary)).decode() + "\n")


if __name__ == "__main__":
    main()
