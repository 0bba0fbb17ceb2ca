"""batchserve inside a Python program, with no HTTP: the engine README's example runs.

python examples/embedded.py
"""

from __future__ import annotations

import asyncio

import batchserve


def shout(inputs: list[str]) -> list[str]:
    """A batch function: one call gets many inputs, returns one output for each."""
    return [text.upper() for text in inputs]


async def main() -> list[str]:
    config = batchserve.Config(max_batch_size=32, timeout_ms=2000)
    async with batchserve.Engine(config, fn=shout, devices="cpu") as engine:
        # Concurrent calls are batched together, exactly as HTTP requests are.
        results = await asyncio.gather(*(engine.infer(f"item {n}") for n in range(100)))
        ticket = engine.submit("later")  # submit-then-poll, like POST /api/requests
        print(ticket.status)  # queued
        print((await ticket).output)  # LATER
    print(f"{len(results)} answers, largest batch {max(r.batch_size for r in results)}")
    return [result.output for result in results]


if __name__ == "__main__":
    asyncio.run(main())
