"""A generation's sampling params, checked once at admission for every door.

The generator reads them from `Seq.params`, a plain dict holding only what the request gave:

    temperature  a number, 0 <= t <= 100; 0 or absent: greedy (the default)
    top_p        a number, 0 < p <= 1; 1 or absent: off
    top_k        an int, -1 or 0: off, else 1 to 1,000,000
    seed         an int in the signed 64-bit range
    ignore_eos   true or false: the generator never ends a sequence on its own
    min_tokens   an int, 0 <= min_tokens <= max_tokens: no end of sequence before it
    logprobs     an int, 0 to 20: report each token's log-probability and that many of the
                 most likely tokens at its place (a generator with `reports_logprobs`)
    prompt_logprobs  the same for the prompt's tokens (what `echo` reports)

`null` means absent, so `{}` stays `{}`. Other keys are a custom generator's own and pass
through unchanged. A value of the wrong type or range is the client's mistake (400 naming the
field and its rule), never a failed step of the generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidInput

MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1_000_000
SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_LOGPROBS = 20
"""The most alternatives a token's log-probabilities may list (OpenAI's and vLLM's bound)."""
LOGPROBS = ("logprobs", "prompt_logprobs")
"""vLLM's names of the params that ask for log-probabilities."""
KNOWN = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens", *LOGPROBS)
"""The params every generator may read; each has its rule in `_RULES`."""


def _number(value: object) -> float | None:
    """`value` as a finite float, if it is a JSON number (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        return None
    return number if math.isfinite(number) else None


def _integer(value: object) -> int | None:
    """`value` as an int if it is a whole JSON number: 482.0 is 482, as in JSON Schema."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None if isinstance(value, bool) or not isinstance(value, int) else value


def _temperature(value: object) -> float | None:
    number = _number(value)
    return number if number is not None and 0 <= number <= MAX_TEMPERATURE else None


def _top_p(value: object) -> float | None:
    number = _number(value)
    return number if number is not None and 0 < number <= 1 else None


def _top_k(value: object) -> int | None:
    number = _integer(value)
    return number if number is not None and -1 <= number <= MAX_TOP_K else None


def _seed(value: object) -> int | None:
    number = _integer(value)
    return number if number is not None and SEED_RANGE[0] <= number <= SEED_RANGE[1] else None


def _ignore_eos(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _min_tokens(value: object) -> int | None:
    number = _integer(value)
    return number if number is not None and number >= 0 else None


def _logprobs(value: object) -> int | None:
    number = _integer(value)
    return number if number is not None and 0 <= number <= MAX_LOGPROBS else None


_RULES: dict[str, tuple[Callable[[object], Any], str]] = {
    "temperature": (_temperature, f"a number from 0 to {MAX_TEMPERATURE:g} (0: greedy)"),
    "top_p": (_top_p, "a number above 0 and at most 1 (1: off)"),
    "top_k": (_top_k, f"an integer from 1 to {MAX_TOP_K:,}, or -1 or 0 (off)"),
    "seed": (_seed, "an integer from -2**63 to 2**63-1"),
    "ignore_eos": (_ignore_eos, "true or false"),
    "min_tokens": (_min_tokens, "an integer from 0 to max_tokens"),
    "logprobs": (_logprobs, f"an integer from 0 to {MAX_LOGPROBS}"),
    "prompt_logprobs": (_logprobs, f"an integer from 0 to {MAX_LOGPROBS}"),
}


def checked_params(params: Mapping[str, Any] | None, max_tokens: int) -> dict[str, Any]:
    """`params` with its known keys checked (and numbers as the rule's type), its nulls
    dropped and its other keys as given; InvalidInput names the first field that breaks its
    rule. `max_tokens` is the generation's own limit, which `min_tokens` may not pass."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise InvalidInput(f"params must be a JSON object, not {type(params).__name__}")
    checked: dict[str, Any] = {}
    for name, value in params.items():
        if value is None:
            continue
        rule = _RULES.get(name)
        if rule is None:
            checked[name] = value
            continue
        read, wanted = rule
        good = read(value)
        if good is None:
            raise InvalidInput(f'"{name}" must be {wanted}, not {_shown(value)}')
        checked[name] = good
    if checked.get("min_tokens", 0) > max_tokens:
        raise InvalidInput(
            f'"min_tokens" {checked["min_tokens"]} is more than max_tokens {max_tokens}'
        )
    return checked


def _shown(value: object) -> str:
    """The refused value, short: a client's 1 MB string is not echoed back whole."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str | int | float):
        text = repr(value)
    else:
        text = "an object" if isinstance(value, Mapping) else f"a {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


SCHEMAS: dict[str, dict[str, Any]] = {
    "temperature": {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "maximum": MAX_TOP_K},
    "seed": {"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]},
    "ignore_eos": {"type": "boolean"},
    "min_tokens": {
        "type": "integer",
        "minimum": 0,
        "description": "at most max_tokens (the request's, or the default it gets); more is"
        " 400, a rule JSON Schema cannot state",
    },
    "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
    "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
}
"""Each known param's rule (`_RULES`) as JSON Schema, null allowed, for the OpenAPI document."""
SCHEMAS = {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in SCHEMAS.items()}
