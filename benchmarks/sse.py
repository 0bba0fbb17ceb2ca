"""An OpenAI-shaped stream as the LM benchmarks read it: each `data: {...}` event parsed, and
the text piece a completion or chat event carries."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


async def events(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """POSTs `body` and yields each JSON event of its stream; a status other than 200 raises
    with the answer's text (`[DONE]` and comments are skipped)."""
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} {response.status}: {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data: {"):
                yield json.loads(line[6:])


def piece(event: dict[str, Any]) -> str:
    """The text an event adds: a completion's `text` or a chat delta's `content`."""
    choice = (event.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""
