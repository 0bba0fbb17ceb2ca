"""The bodies of Text Embeddings Inference's routes and of /v1/rerank, read and checked:
what `retrieval_api.py` sends the engine, and how its answers are made. Nothing here awaits.

TEI's rules, kept where its clients can tell: a field of the wrong type or value is 422, an
empty query or list is 400 (TEI's "empty"), an input over the model's length without
`truncate` and a list over the cap are 413; each names the field. Every input is checked
before any is sent, so a refused request puts nothing on a device; the check of lengths,
which tokenizes, is the plan's `check`, which the engine runs off the event loop for a long
list (engine/counting.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..errors import InputTooLarge, InvalidInput, Unprocessable
from ..models.retrieval import Item, TextModel, fits_by_bytes, pair_text

DIRECTIONS = {"right": "right", "left": "left", "Right": "right", "Left": "left"}


class Plan(NamedTuple):
    """A request read: the model, one engine input per item, their params, the rest of the
    body that shapes the answer, and the check of its items' lengths (`lengths`)."""

    model: str
    texts: list[str]
    params: dict[str, Any] | None
    options: dict[str, Any]
    check: Callable[[], None] | None = None


def check_fields(payload: dict[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(payload.keys() - known)
    if unknown:
        raise Unprocessable(f"unknown field(s): {', '.join(unknown)[:200]}")


def flag(payload: dict[str, Any], name: str, default: bool) -> bool:
    value = payload.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise Unprocessable(f'"{name}" must be true or false')
    return value


def model_field(payload: dict[str, Any]) -> str | None:
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise Unprocessable('"model" must be a string')
    return model


def direction(payload: dict[str, Any]) -> str:
    given = payload.get("truncation_direction")
    if given is None:
        return "right"
    if not isinstance(given, str) or given not in DIRECTIONS:
        raise Unprocessable('"truncation_direction" must be "right" or "left"')
    return DIRECTIONS[given]


def no_prompt(payload: dict[str, Any]) -> None:
    if payload.get("prompt_name") is not None:
        raise Unprocessable('"prompt_name": this server applies no prompts; send null')


def texts_of(given: object, field: str, *, single: bool = True) -> list[str]:
    """A string (when `single`) or a non-empty list of strings."""
    if single and isinstance(given, str):
        return [given]
    if not isinstance(given, list) or not all(isinstance(text, str) for text in given):
        kind = "a string or a list of strings" if single else "a list of strings"
        raise Unprocessable(f'"{field}" must be {kind} (token ids are not taken)')
    if not given:
        raise InvalidInput(f'"{field}" is empty: send at least one text')
    return given


def check_count(count: int, field: str, cap: int) -> None:
    if count > cap:
        raise InputTooLarge(
            f'"{field}" holds {count} inputs; the limit is {cap} (--retrieval-max-inputs):'
            " send them in several requests"
        )


def lengths(
    items: Callable[[], Sequence[Item]], field: str, text_model: TextModel, truncate: bool
) -> Callable[[], None] | None:
    """The check that refuses (413) an item over the model's length, unless truncation was
    asked for (then none)."""
    if truncate:
        return None
    return lambda: check_lengths(items(), field, text_model)


def check_lengths(items: Sequence[Item], field: str, text_model: TextModel) -> None:
    longest = text_model.max_input_tokens
    for index, item in enumerate(items):
        if fits_by_bytes(item, longest):
            continue
        tokens = text_model.tokenizer.count(item)
        if tokens > longest:
            raise InputTooLarge(
                f'"{field}"[{index}] is {tokens} tokens; the model takes at most {longest}:'
                ' shorten it, or send "truncate": true'
            )


def params_of(direction_wanted: str, **others: Any) -> dict[str, Any] | None:
    """The params the model's function takes for a request: only what differs from its
    defaults, so that ordinary requests share one compatibility key."""
    params = {name: value for name, value in others.items() if value is not None}
    if direction_wanted != "right":
        params["truncation_direction"] = direction_wanted
    return params or None


def dimensions_of(payload: dict[str, Any], allowed: Callable[[], frozenset[int]]) -> int | None:
    """The `dimensions` asked for: null, or one of the sizes the model declares (400)."""
    wanted = payload.get("dimensions")
    if wanted is None:
        return None
    if isinstance(wanted, bool) or not isinstance(wanted, int):
        raise InvalidInput('"dimensions" must be a whole number')
    sizes = allowed()
    if wanted not in sizes:
        raise InvalidInput(
            f'"dimensions" {wanted} is not a size this model was trained for;'
            f" it takes {', '.join(map(str, sorted(sizes, reverse=True)))}"
        )
    return wanted if wanted < max(sizes) else None


def cut(vector: list[float], size: int | None, normalize: bool) -> list[float]:
    """A Matryoshka vector cut to its first `size` numbers, unit length again if asked."""
    if size is None:
        return vector
    kept = vector[:size]
    if not normalize:
        return kept
    norm = math.sqrt(math.fsum(x * x for x in kept))
    return [x / norm for x in kept] if norm > 0 else kept


def pairs(query: str, texts: list[str]) -> list[str]:
    return [pair_text(query, text) for text in texts]


def query_of(payload: dict[str, Any]) -> str:
    query = payload.get("query")
    if not isinstance(query, str):
        raise Unprocessable('"query" must be a string')
    if not query:
        raise InvalidInput('"query" is empty')
    return query


def predict_items(given: object) -> tuple[list[Item], bool]:
    """/predict's `inputs`: a text, a pair, or a list of [text] and [text, text]; and
    whether it was a list (answered with a list of lists)."""
    if isinstance(given, str):
        return [given], False
    if _pair(given):
        return [(given[0], given[1])], False  # type: ignore[index]
    if not isinstance(given, list) or not all(
        isinstance(one, list) and 1 <= len(one) <= 2 and all(isinstance(t, str) for t in one)
        for one in given
    ):
        raise Unprocessable(
            '"inputs" must be a string, a pair [text, text], or a list of [text] and [text, text]'
        )
    if not given:
        raise InvalidInput('"inputs" is empty')
    return [one[0] if len(one) == 1 else (one[0], one[1]) for one in given], True


def _pair(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(t, str) for t in value)


def item_text(item: Item) -> str:
    return item if isinstance(item, str) else pair_text(*item)


def sigmoid(logit: float) -> float:
    return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1 + math.exp(logit))


def scores(logits: list[float], raw: bool) -> list[float]:
    """A classifier's scores: its logits raw, else sigmoid for one label, softmax for more."""
    if raw:
        return logits
    if len(logits) == 1:
        return [sigmoid(logits[0])]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


def ranked(logits: Sequence[list[float]], raw: bool) -> list[tuple[int, float]]:
    """Each text's index and score, best first (ties: the earlier text first)."""
    scored = [(index, scores(row, raw)[0]) for index, row in enumerate(logits)]
    return sorted(scored, key=lambda pair: (-pair[1], pair[0]))


def ids_of(given: object) -> tuple[list[list[int]], bool]:
    """/decode's `ids`: a list of ids, or a list of such lists; and whether it was a list
    of lists."""
    if isinstance(given, list) and given and all(isinstance(row, list) for row in given):
        rows, nested = given, True
    else:
        rows, nested = [given], False
    for row in rows:
        if not isinstance(row, list) or not all(type(i) is int and 0 <= i < 2**32 for i in row):
            raise Unprocessable('"ids" must be a list of token ids, or a list of such lists')
    return rows, nested
