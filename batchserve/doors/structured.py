"""Structured output fields: what a request's output must keep to, read from OpenAI's
`response_format` or vLLM's names for the same (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` before vLLM 0.12; `structured_outputs` with `json`,
`regex`, `choice`, `grammar` or `json_object` since 0.10), on `/v1/completions`,
`/v1/chat/completions` and `/api/generate`.

At most one of them may ask for a constraint; `response_format: {"type": "text"}` asks for
none. A value of the wrong shape is refused here (400, naming the field); the grammar's own
compile (generation/grammars.py) refuses what the engine cannot compile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ..errors import InvalidInput
from ..models.grammar import Constraint, GrammarSpec

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_FIELDS = ("response_format", *GUIDED_FIELDS, "structured_outputs")
"""Top-level fields read here, on every generation route."""
_OUTPUTS_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                 "grammar": "guided_grammar", "json_object": ""}  # fmt: skip
MAX_CHOICES = 1024


def constraint_of(payload: Mapping[str, Any]) -> Constraint | None:
    """The body's constraint, or None; InvalidInput naming the field for a bad one."""
    found: list[Constraint] = []
    response_format = payload.get("response_format")
    if response_format is not None:
        found += _response_format(response_format)
    for name in GUIDED_FIELDS:
        if payload.get(name) is not None:
            found.append(_guided(name, payload[name], name))
    outputs = payload.get("structured_outputs")
    if outputs is not None:
        found += _structured_outputs(outputs)
    if len(found) > 1:
        raise InvalidInput(
            f"{' and '.join(c.field for c in found)} each ask for a constraint; give one"
        )
    return found[0] if found else None


def json_schema_text(schema: object, field: str) -> str:
    """A JSON schema as compact text in the order given: properties are written in the order
    the schema lists them, so the text is not re-sorted."""
    if not isinstance(schema, Mapping | bool):
        raise InvalidInput(f'"{field}" must be a JSON schema (an object)')
    return orjson.dumps(schema).decode()


def _response_format(value: object) -> list[Constraint]:
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return []
    if kind == "json_object":
        return [Constraint(GrammarSpec("json_object"), "response_format")]
    if kind != "json_schema":
        raise InvalidInput(
            '"response_format" must be {"type": "text"}, {"type": "json_object"} or'
            ' {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
        )
    assert isinstance(value, Mapping)
    described = value.get("json_schema")
    field = "response_format.json_schema.schema"
    if not isinstance(described, Mapping) or "schema" not in described:
        raise InvalidInput(f'"{field}" is missing: give the JSON schema the output must follow')
    if described.get("strict") not in (None, True, False):
        raise InvalidInput('"response_format.json_schema.strict" must be true or false')
    return [
        Constraint(GrammarSpec("json_schema", json_schema_text(described["schema"], field)), field)
    ]


def _guided(kind: str, value: object, field: str) -> Constraint:
    if kind == "guided_json":
        if isinstance(value, str):  # the schema's JSON text: written again, one cache key
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError:
                raise InvalidInput(f'"{field}": the schema\'s text is not JSON') from None
        return Constraint(GrammarSpec("json_schema", json_schema_text(value, field)), field)
    if kind == "guided_choice":
        return Constraint(GrammarSpec("grammar", _choice_grammar(value, field)), field)
    if not isinstance(value, str) or not value:
        raise InvalidInput(f'"{field}" must be a non-empty string')
    return Constraint(GrammarSpec("regex" if kind == "guided_regex" else "grammar", value), field)


def _structured_outputs(value: object) -> list[Constraint]:
    if not isinstance(value, Mapping):
        raise InvalidInput('"structured_outputs" must be an object')
    unknown = sorted(set(value) - set(_OUTPUTS_KEYS))
    if unknown:
        raise InvalidInput(f'"structured_outputs" has unknown key(s): {", ".join(unknown)[:200]}')
    found = []
    for key, kind in _OUTPUTS_KEYS.items():
        given = value.get(key)
        if given is None or given is False:
            continue
        field = f"structured_outputs.{key}"
        if not kind:
            if given is not True:
                raise InvalidInput(f'"{field}" must be true or false')
            found.append(Constraint(GrammarSpec("json_object"), field))
        else:
            found.append(_guided(kind, given, field))
    return found


def _choice_grammar(value: object, field: str) -> str:
    """An EBNF grammar whose only sentences are the choices."""
    if (
        not isinstance(value, list)
        or not value
        or len(value) > MAX_CHOICES
        or not all(isinstance(choice, str) and choice for choice in value)
    ):
        raise InvalidInput(f'"{field}" must be a list of 1 to {MAX_CHOICES} non-empty strings')
    return "root ::= " + " | ".join(orjson.dumps(choice).decode() for choice in value)


SCHEMA = {"type": ["object", "boolean"]}
_GRAMMAR_TEXT = {"type": ["string", "null"], "minLength": 1}
_CHOICES = {"type": ["array", "null"], "minItems": 1, "maxItems": MAX_CHOICES,
            "items": {"type": "string", "minLength": 1}}  # fmt: skip
STRUCTURED_SCHEMAS: dict[str, Any] = {
    "response_format": {
        "anyOf": [
            {"type": "null"},
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": ["text", "json_object"]}},
            },
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {
                        "type": "object",
                        "required": ["schema"],
                        "properties": {"name": {"type": "string"}, "schema": SCHEMA,
                                       "strict": {"type": ["boolean", "null"]}},
                    },
                },
            },
        ]
    },
    "guided_json": {"anyOf": [{"type": "string"}, SCHEMA, {"type": "null"}]},
    "guided_regex": _GRAMMAR_TEXT,
    "guided_choice": _CHOICES,
    "guided_grammar": _GRAMMAR_TEXT,
    "structured_outputs": {
        "type": ["object", "null"],
        "additionalProperties": False,
        "properties": {
            "json": {"anyOf": [{"type": "string"}, SCHEMA, {"type": "null"}]},
            "regex": _GRAMMAR_TEXT,
            "choice": _CHOICES,
            "grammar": _GRAMMAR_TEXT,
            "json_object": {"type": ["boolean", "null"]},
        },
    },
}  # fmt: skip
