"""Open-loop load generator: Poisson arrivals on a fixed schedule, latency from schedule.

Each request is sent at its scheduled time whatever the server is doing (open loop), and its
latency is counted from that scheduled time, so a slow server cannot hide its queueing by
slowing the sender. Every 200 answer is checked against its own input (the simulated model
reverses it). For chaos runs, `--poison-rate` marks that share of inputs with the simulated
backend's poison marker (they must come back 500, and are left out of the latency figures),
and `--hang-at-s` puts its hang marker in the first input sent after that time.
A lean HTTP/1.1 keep-alive client on asyncio protocols keeps one core able to offer well over
10,000 requests per second.

    taskset -c 1 python benchmarks/loadgen.py --url http://127.0.0.1:8000 --rate 500
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from typing import cast
from urllib.parse import urlsplit

import orjson
import uvloop


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
    statuses: dict[str, int]
    wrong_output: int
    unanswered: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    achieved_rps: float
    """200 answers over the time from the first send to the last answer."""
    mean_batch: float
    batch_sizes: dict[str, int]
    """How many timed 200 answers came from a batch of each size."""
    compute_p50_ms: float
    by_key: dict[str, dict[str, object]]
    """With --keys: sent, success, p50/p99 (200s) and statuses for each named key."""


class Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

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
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("the server closed the connection"))

    async def request(self, payload: bytes, host: str, extra: bytes = b"") -> tuple[int, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(
            b"POST /api/inference HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
            b"%bContent-Length: %d\r\n\r\n%b" % (host.encode(), extra, len(payload), payload)
        )
        return await self.waiter


class Pool:
    """At most `limit` requests on the wire; past that a request waits here (still timed)."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Connection] = []
        self.slots = asyncio.Semaphore(limit)

    async def open(self) -> Connection:
        _, conn = await asyncio.get_running_loop().create_connection(
            Connection, self.host, self.port
        )
        return conn

    async def acquire(self) -> Connection:
        await self.slots.acquire()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        try:
            return await self.open()
        except BaseException:
            self.slots.release()
            raise

    def release(self, conn: Connection) -> None:
        if not conn.closed:
            self.idle.append(conn)
        self.slots.release()


POISON_MARKER = "!poison!"
HANG_MARKER = "!hang!"


async def run(url: str, rate: float, seconds: float, warmup_s: float, seed: int,
              connections: int, timeout_s: float, poison_rate: float = 0.0,
              hang_at_s: float | None = None,
              keys: list[tuple[str, str, float]] | None = None) -> Summary:  # fmt: skip
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    schedule: list[float] = []
    clock = 0.0
    while (clock := clock + rng.expovariate(rate)) < seconds:
        schedule.append(clock)
    poisoned = {index for index in range(len(schedule)) if rng.random() < poison_rate}
    names = [name for name, _, _ in keys or []]
    chosen = rng.choices(names, [w for _, _, w in keys or []], k=len(schedule)) if keys else []
    headers = {name: b"Authorization: Bearer %b\r\n" % key.encode() for name, key, _ in keys or []}
    per_key: dict[str, tuple[Counter[str], list[float]]] = {n: (Counter(), []) for n in names}
    hang_index = next(
        (index for index, at in enumerate(schedule) if hang_at_s is not None and at >= hang_at_s),
        None,
    )
    pool = Pool(host, port, connections)
    warm = min(connections, max(8, int(rate * 0.3)))
    pool.idle = list(await asyncio.gather(*(pool.open() for _ in range(warm))))
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    batch_sizes: list[int] = []
    computes: list[float] = []
    last_answer = 0.0
    wrong = 0
    poison_500 = 0

    async def one(index: int, scheduled: float, counted: bool) -> None:
        nonlocal wrong, last_answer, poison_500
        text = f"req-{seed}-{index}-{'abcdefgh'[: index % 9]}"
        if index in poisoned:
            text += POISON_MARKER
        if index == hang_index:
            text += HANG_MARKER
        name = chosen[index] if chosen else ""
        conn = await pool.acquire()
        try:
            status, body = await asyncio.wait_for(
                conn.request(orjson.dumps({"input": text}), host, headers.get(name, b"")),
                timeout_s,
            )
        except (TimeoutError, ConnectionError):
            statuses["lost"] += 1
            if name:
                per_key[name][0]["lost"] += 1
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()
            return
        finally:
            pool.release(conn)
        last_answer = loop.time()
        if index in poisoned:
            poison_500 += status == 500
            return
        statuses[str(status)] += 1
        if name:
            per_key[name][0][str(status)] += 1
        if status == 200:
            answer = orjson.loads(body)
            if name and counted:
                per_key[name][1].append(loop.time() - scheduled)
            if answer["output"] != text[::-1]:
                wrong += 1
            if counted:
                latencies.append(loop.time() - scheduled)
                batch_sizes.append(answer["batch_size"])
                computes.append(answer.get("compute_ms", 0.0))

    start = loop.time() + 0.05
    tasks = []
    for index, offset in enumerate(schedule):
        scheduled = start + offset
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index, scheduled, offset >= warmup_s)))
    await asyncio.gather(*tasks)
    latencies.sort()

    def pct(q: float, values: list[float] = latencies) -> float:
        if not values:
            return float("nan")
        return 1e3 * values[min(len(values) - 1, int(len(values) * q))]

    by_key: dict[str, dict[str, object]] = {}
    for name, (counts, times) in per_key.items():
        times.sort()
        sent = sum(counts.values())
        by_key[name] = {"sent": sent, "success": counts["200"] / sent if sent else 0.0,
                        "p50_ms": pct(0.5, times), "p99_ms": pct(0.99, times),
                        "statuses": dict(counts)}  # fmt: skip

    ok = statuses["200"]
    clean = len(schedule) - len(poisoned)
    return Summary(
        rate=rate,
        seconds=seconds,
        sent=len(schedule),
        ok=ok,
        success=ok / clean if clean else 0.0,
        poison_sent=len(poisoned),
        poison_500=poison_500,
        statuses=dict(statuses),
        wrong_output=wrong,
        unanswered=statuses["lost"],
        p50_ms=pct(0.50),
        p90_ms=pct(0.90),
        p99_ms=pct(0.99),
        max_ms=1e3 * latencies[-1] if latencies else float("nan"),
        achieved_rps=ok / (last_answer - start) if last_answer > start else 0.0,
        mean_batch=sum(batch_sizes) / len(batch_sizes) if batch_sizes else 0.0,
        batch_sizes={str(size): n for size, n in sorted(Counter(batch_sizes).items())},
        compute_p50_ms=sorted(computes)[len(computes) // 2] if computes else float("nan"),
        by_key=by_key,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--rate", type=float, required=True, help="offered requests per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the schedule")
    parser.add_argument(
        "--warmup-s", type=float, default=1.0, help="arrivals this early are checked, not timed"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--connections", type=int, default=4000)
    parser.add_argument("--timeout-s", type=float, default=15.0)
    parser.add_argument(
        "--poison-rate", type=float, default=0.0, help="share of inputs with the poison marker"
    )
    parser.add_argument(
        "--hang-at-s", type=float, default=None, help="send the hang marker at this time"
    )
    parser.add_argument(
        "--keys",
        default="",
        help="API keys to mix, name=key:weight,...; each request draws one by weight",
    )
    args = parser.parse_args()
    keys = [
        (name, key, float(weight))
        for name, rest in (part.split("=", 1) for part in args.keys.split(",") if part)
        for key, weight in [rest.rsplit(":", 1)]
    ]
    summary = uvloop.run(
        run(args.url, args.rate, args.seconds, args.warmup_s, args.seed, args.connections,
            args.timeout_s, args.poison_rate, args.hang_at_s, keys or None)
    )  # fmt: skip
    sys.stdout.write(orjson.dumps(asdict(summary)).decode() + "\n")


if __name__ == "__main__":
    main()
