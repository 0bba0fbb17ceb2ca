"""Which fields of an OpenAI completions or chat body this server takes, and at what values.

Clients and benchmark tools send OpenAI's whole vocabulary. A field is one of three kinds:

- read: the prompt or messages, `max_tokens`, `stop`, `stream`, vLLM's `cache_salt`, `n`,
  log probabilities and `echo` (`openai_choices.py`), the structured output fields
  (`response_format` and vLLM's, `structured.py`), a chat's `tools` and `tool_choice`
  (`tool_calls.py`), and the sampling fields (`temperature`, `top_p`, `seed`, and vLLM's
  `top_k`, `ignore_eos`, `min_tokens`), which go to the generator as params
  (`rules/sampling_params.py` checks them);
- neutral: taken and ignored at a value that changes nothing about the answer here
  (a completion's `tools: []`, `store`, `metadata`, `user`, `best_of: 1`, a penalty of 0,
  ...); at any other value refused with 400 naming the
  field, since the answer would not be what was asked for;
- unknown: refused with 400, named.

`null` is always taken as absent, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidInput
from .openai_choices import CHAT_FIELDS, COMPLETION_FIELDS
from .structured import STRUCTURED_FIELDS

SAMPLING_FIELDS = ("temperature", "top_p", "seed", "top_k", "ignore_eos", "min_tokens")
"""Top-level fields that become the generation's params, as given."""
READ = frozenset(
    {"model", "max_tokens", "stop", "stream", "stream_options", "cache_salt", *SAMPLING_FIELDS,
     *STRUCTURED_FIELDS}
)  # fmt: skip
COMPLETION_READ = READ | {"prompt", *COMPLETION_FIELDS}
CHAT_READ = READ | {"messages", "max_completion_tokens", "tools", "tool_choice", *CHAT_FIELDS}


def _is_number(wanted: float) -> Callable[[object], bool]:
    """`wanted` as a JSON number: 1.0 is 1, as in JSON Schema (a bool is not)."""
    return lambda value: type(value) in (int, float) and value == wanted


def _is(*wanted: object) -> Callable[[object], bool]:
    """One of `wanted`, of the same type (so that `true` is not taken for 1)."""
    return lambda value: any(type(value) is type(w) and value == w for w in wanted)


def _of_type(*types: type) -> Callable[[object], bool]:
    return lambda value: isinstance(value, types)


_Rule = tuple[Callable[[object], bool], str, str]
"""A neutral field's test, the value(s) it passes in words, and why no other value will do."""

_NEUTRAL: dict[str, _Rule] = {
    "presence_penalty": (_is_number(0), "0", "penalties are not applied"),
    "frequency_penalty": (_is_number(0), "0", "penalties are not applied"),
    "repetition_penalty": (_is_number(1), "1", "penalties are not applied"),
    "min_p": (_is_number(0), "0", "min_p sampling is not supported"),
    "logit_bias": (_is({}), "{}", "logit bias is not applied"),
    "tools": (_is([]), "[]", "tool calls are not supported"),
    "tool_choice": (_is("none", "auto"), '"none" or "auto"', "tool calls are not supported"),
    "functions": (_is([]), "[]", "function calls are not supported"),
    "function_call": (_is("none", "auto"), '"none" or "auto"', "function calls are not supported"),
    "parallel_tool_calls": (_of_type(bool), "true or false", ""),
    "modalities": (_is(["text"]), '["text"]', "text is the only output"),
    "store": (_of_type(bool), "true or false", ""),
    "metadata": (_of_type(Mapping), "an object", ""),
    "service_tier": (_of_type(str), "a string", ""),
    "user": (_of_type(str), "a string", ""),
    "prompt_cache_key": (_of_type(str), "a string", ""),
    "safety_identifier": (_of_type(str), "a string", ""),
}
_COMPLETION_NEUTRAL = {
    **_NEUTRAL,
    "best_of": (_is_number(1), "1", "best_of is not supported (n choices are)"),
    "suffix": (_is(""), '""', "a suffix is not supported"),
}


def check_fields(payload: Mapping[str, Any], *, chat: bool) -> None:
    """Refuses (InvalidInput, naming the field) an unknown field, or a neutral one at a value
    that would change the answer."""
    read = CHAT_READ if chat else COMPLETION_READ
    neutral = _NEUTRAL if chat else _COMPLETION_NEUTRAL
    unknown = sorted(name for name in payload if name not in read and name not in neutral)
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(unknown)[:200]}")
    for name, value in payload.items():
        rule = None if name in read else neutral.get(name)
        if rule is not None and value is not None and not rule[0](value):
            passes, why = rule[1], rule[2]
            raise InvalidInput(f'"{name}" must be {passes} or null' + (f": {why}" if why else ""))


def sampling_params(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The body's sampling fields that are not null, as the generation's params."""
    return {name: payload[name] for name in SAMPLING_FIELDS if payload.get(name) is not None}


def _or_null(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_NEUTRAL_SCHEMAS: dict[str, dict[str, Any]] = {
    "presence_penalty": {"const": 0},
    "frequency_penalty": {"const": 0},
    "repetition_penalty": {"const": 1},
    "min_p": {"const": 0},
    "logit_bias": {"type": "object", "maxProperties": 0},
    "tools": {"type": "array", "maxItems": 0},
    "tool_choice": {"enum": ["none", "auto"]},
    "functions": {"type": "array", "maxItems": 0},
    "function_call": {"enum": ["none", "auto"]},
    "parallel_tool_calls": {"type": "boolean"},
    "modalities": {"type": "array", "prefixItems": [{"const": "text"}], "minItems": 1,
                   "maxItems": 1},
    "store": {"type": "boolean"},
    "metadata": {"type": "object"},
    "service_tier": {"type": "string"},
    "user": {"type": "string"},
    "prompt_cache_key": {"type": "string"},
    "safety_identifier": {"type": "string"},
    "best_of": {"const": 1},
    "suffix": {"const": ""},
}  # fmt: skip
"""The values each neutral field takes, as JSON Schema, for the OpenAPI document
(tests/test_openapi.py checks that it names exactly the fields `_NEUTRAL` rules)."""


def neutral_schemas(*, chat: bool) -> dict[str, dict[str, Any]]:
    """The body's neutral fields, each at the value(s) it takes or null."""
    names = _NEUTRAL if chat else _COMPLETION_NEUTRAL
    read = CHAT_READ if chat else COMPLETION_READ
    return {name: _or_null(_NEUTRAL_SCHEMAS[name]) for name in names if name not in read}
