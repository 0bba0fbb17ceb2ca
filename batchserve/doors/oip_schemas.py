"""The Open Inference Protocol's bodies as JSON Schema, for /openapi.json (`doors/oip.py`
declares its routes with them): server and model metadata, an inference request and
answer, and the protocol's error body.

The model's shape is ours: one input tensor, `input`, and one output, `output`, both BYTES
strings of shape [N] or [N, 1].
"""

from __future__ import annotations

from typing import Any

from ..engine.requests import MAX_INPUTS_PER_CALL

INPUT, OUTPUT = "input", "output"

_TENSOR: dict[str, Any] = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
    },
}
_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {"type": ["string", "number", "boolean"]},
}
_STRINGS: dict[str, Any] = {
    "type": "array",
    "items": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
}
SERVER_METADATA_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "version", "extensions"],
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "string"},
        "extensions": {"type": "array", "items": {"type": "string"}},
    },
}
METADATA_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "platform", "inputs", "outputs"],
    "properties": {
        "name": {"type": "string"},
        "versions": {"type": "array", "items": {"type": "string"}},
        "platform": {"type": "string"},
        "inputs": {"type": "array", "items": _TENSOR},
        "outputs": {"type": "array", "items": _TENSOR},
    },
}
INFER_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["inputs"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string"},
        "parameters": _PARAMETERS,
        "inputs": {
            "type": "array",
            "minItems": 1,
            "maxItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype", "data"],
                "additionalProperties": False,
                "properties": {
                    "name": {"const": INPUT},
                    "shape": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 2,
                        "prefixItems": [
                            {"type": "integer", "minimum": 1, "maximum": MAX_INPUTS_PER_CALL},
                            {"const": 1},
                        ],
                        "description": "[N] or [N, 1]: N must be the number of strings in"
                        " data (400 otherwise), a rule JSON Schema cannot state; with API keys,"
                        " N is at most the tier's burst (400 OVER_TIER_BURST otherwise)",
                    },
                    "datatype": {"const": "BYTES"},
                    "parameters": _PARAMETERS,
                    "data": _STRINGS,
                },
            },
        },
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {"name": {"const": OUTPUT}, "parameters": _PARAMETERS},
            },
        },
    },
}
INFER_RESPONSE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model_name", "outputs"],
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "outputs": {
            "type": "array",
            "items": {**_TENSOR, "properties": {
                **_TENSOR["properties"], "parameters": _PARAMETERS, "data": _STRINGS,
            }},
        },
    },
}  # fmt: skip
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {"type": "string"},
        "code": {"type": "string"},
        "request_id": {"type": "string"},
        "retry_after_ms": {"type": "integer"},
    },
}
