"""What the retrieval doors (Text Embeddings Inference's routes, /v1/rerank) read of a loaded
model: its tokenizer, its longest input, its labels. Pure: nothing here loads a model.

A batch function serves them by exposing, beside `embedding_dim` (an embedder) or `labels`
(a classifier, such as a cross-encoder: `cross_encoder.py`), `max_input_tokens` and a
`tokenizer` of the `Tokenizing` shape. An input is one text, or, for a classifier, a pair of
texts written as a JSON array of two strings (`pair_text`): one batch item, costed by its
tokens like any other, so a pair of a query and a passage batches with everyone else's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import orjson

Item = str | tuple[str, str]
"""A text, or a (query, passage) pair."""


@runtime_checkable
class Tokenizing(Protocol):
    """A model's tokenizer as the doors use it: counting, /tokenize and /decode."""

    def count(self, item: Item) -> int:
        """The item's tokens, specials included, before any truncation."""
        ...

    def tokens(self, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
        """TEI's /tokenize answer for one text: id, text, special, start, stop."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


@dataclass(frozen=True)
class TextModel:
    """A loaded model's facts for the retrieval doors."""

    max_input_tokens: int
    tokenizer: Tokenizing
    labels: tuple[str, ...] | None
    """A classifier's labels (one: a reranker); None for an embedder."""


def text_model_of(fn: object) -> TextModel | None:
    """The facts a batch function exposes, or None where it exposes no tokenizer."""
    tokenizer = getattr(fn, "tokenizer", None)
    longest = getattr(fn, "max_input_tokens", None)
    if not (isinstance(longest, int) and longest > 0 and isinstance(tokenizer, Tokenizing)):
        return None
    labels = getattr(fn, "labels", None)
    named = tuple(str(label) for label in labels) if isinstance(labels, list | tuple) else None
    return TextModel(longest, tokenizer, named or None)


def pair_text(query: str, passage: str) -> str:
    """A pair as one batch input: the JSON array of its two texts."""
    return orjson.dumps([query, passage]).decode()


def split_pair(text: str) -> Item:
    """An input as a classifier reads it: a JSON array of two strings is a pair, anything
    else one text (so a text that is such an array is read as the pair it spells)."""
    if not text.startswith("["):
        return text
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return value[0], value[1]
    return text


def fits_by_bytes(item: Item, max_tokens: int) -> bool:
    """Whether the item surely fits `max_tokens` by its UTF-8 bytes alone: a token covers at
    least one byte, but for a few markers and specials (8 at most here), so a short input
    needs no tokenizer to know it fits."""
    texts = (item,) if isinstance(item, str) else item
    size = sum(len(t) if t.isascii() else len(t.encode()) for t in texts)
    return size + 8 <= max_tokens
