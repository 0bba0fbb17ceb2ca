"""The bodies loadgen.py sends with `--shape`, and how each answer is checked: the batch
route (`inference`, the simulated model's reversed input) or the retrieval routes, TEI's
`/embed` and `/rerank` and Infinity's `/rerank`, over the same query and passages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

QUERY = "which passage says how the weather in paris changes in spring"
PASSAGES = 10
"""Passages a rerank request holds: each is one (query, passage) pair to score."""
_WORDS = [
    "the",
    "city",
    "river",
    "spring",
    "rain",
    "sun",
    "cloud",
    "warm",
    "cold",
    "morning",
    "evening",
    "market",
    "bridge",
    "museum",
    "garden",
    "street",
    "cafe",
    "train",
    "station",
    "north",
    "south",
    "wind",
    "season",
    "tourist",
    "history",
    "art",
]


def passages(text: str) -> list[str]:
    """`PASSAGES` passages of about 50 words for request `text` (unique per request)."""
    seed = sum(map(ord, text))
    return [
        f"{text} {i}: " + " ".join(_WORDS[(seed + i * 7 + j * 3) % len(_WORDS)] for j in range(48))
        for i in range(PASSAGES)
    ]


class Shape(NamedTuple):
    path: str
    body: Callable[[str], dict[str, Any]]
    check: Callable[[Any, str], bool]
    """Whether a 200 answer is right for its request's text."""


SHAPES = {
    "inference": Shape(
        "/api/inference", lambda text: {"input": text},
        lambda answer, text: answer["output"] == text[::-1],
    ),
    "embed": Shape(
        "/embed", lambda text: {"inputs": text},
        lambda answer, text: len(answer) == 1 and len(answer[0]) > 1,
    ),
    "rerank": Shape(
        "/rerank", lambda text: {"query": QUERY, "texts": passages(text)},
        lambda answer, text: sorted(row["index"] for row in answer) == list(range(PASSAGES)),
    ),
    "infinity-rerank": Shape(
        "/rerank", lambda text: {"query": QUERY, "documents": passages(text), "model": "rerank"},
        lambda answer, text: len(answer["results"]) == PASSAGES,
    ),
}  # fmt: skip
