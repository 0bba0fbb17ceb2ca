"""The OpenAPI operations of the retrieval door (`retrieval_api.py`): TEI's bodies and
answers as its own document states them, and the Cohere/Jina-shaped /v1/rerank."""

from __future__ import annotations

from typing import Any

from .openapi import REQUEST_ID, Operation, Schema, errors, json_answer

TEI_ERROR: Schema = {
    "title": "TeiError",
    "type": "object",
    "required": ["error", "error_type"],
    "properties": {
        "error": {"type": "string"},
        "error_type": {"enum": ["validation", "empty", "overloaded", "unhealthy", "backend"]},
    },
}
_STRINGS = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_TEXTS = {"anyOf": [{"type": "string"}, _STRINGS]}
_FLAG = {"type": ["boolean", "null"]}
_MODEL = {"type": ["string", "null"], "description": "needed where several models of the"
          " route's kind run"}  # fmt: skip
_DIRECTION = {"anyOf": [{"enum": ["right", "left", "Right", "Left"]}, {"type": "null"}]}
_TRUNCATING: dict[str, Any] = {
    "truncate": {**_FLAG, "description": "cut inputs at the model's length (else: 413)"},
    "truncation_direction": _DIRECTION,
    "model": _MODEL,
}
_TOKEN = {
    "type": "object",
    "required": ["id", "text", "special"],
    "properties": {
        "id": {"type": "integer"},
        "text": {"type": "string"},
        "special": {"type": "boolean"},
        "start": {"type": ["integer", "null"]},
        "stop": {"type": ["integer", "null"]},
    },
}
_PREDICTION = {
    "type": "object",
    "required": ["label", "score"],
    "properties": {"label": {"type": "string"}, "score": {"type": "number"}},
}
_PAIR = {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2}
_ONE = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}
_RULES = (
    "Each input, or pair, is one batch item; at most --retrieval-max-inputs of them (413)."
    " A model must expose a tokenizer (docs/models.md, Retrieval); a model of another kind"
    " is 400."
)


def _tei(summary: str, body: Schema, answer: Schema, *statuses: int) -> Operation:
    return Operation(
        summary=summary,
        tag="retrieval",
        description=_RULES,
        parameters=(REQUEST_ID,),
        body=body,
        answers={
            200: json_answer("the answer", answer),
            **errors(400, 401, 404, 413, 422, 429, 500, 503, 504, *statuses, schema=TEI_ERROR),
        },
        auth="key",
    )


EMBED = _tei(
    "Text Embeddings Inference's embeddings: one vector per input, in order",
    {
        "title": "EmbedRequest",
        "type": "object",
        "required": ["inputs"],
        "additionalProperties": False,
        "properties": {
            "inputs": _TEXTS,
            "normalize": _FLAG,
            "prompt_name": {"type": "null"},
            "dimensions": {
                "type": ["integer", "null"],
                "minimum": 1,
                "description": "the width, or a Matryoshka size the model"
                " declares (models file); another is 400",
            },
            **_TRUNCATING,
        },
    },
    {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
)
_RANKS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["index", "score"],
        "properties": {
            "index": {"type": "integer"},
            "score": {"type": "number"},
            "text": {"type": "string"},
        },
    },
}
RERANK = _tei(
    "Text Embeddings Inference's rerank: each text scored against the query, best first",
    {
        "title": "RerankRequest",
        "type": "object",
        "required": ["query", "texts"],
        "additionalProperties": False,
        "properties": {
            "query": {"type": "string", "minLength": 1},
            "texts": _STRINGS,
            "raw_scores": _FLAG,
            "return_text": _FLAG,
            **_TRUNCATING,
        },
    },
    _RANKS,
)
PREDICT = _tei(
    "Text Embeddings Inference's predict: each label's score for a text or a pair",
    {
        "title": "PredictRequest",
        "type": "object",
        "required": ["inputs"],
        "additionalProperties": False,
        "properties": {
            "inputs": {
                "anyOf": [
                    {"type": "string"},
                    _PAIR,
                    {"type": "array", "minItems": 1, "items": {"anyOf": [_ONE, _PAIR]}},
                ]
            },
            "raw_scores": _FLAG,
            "parameters": {"type": ["object", "null"], "additionalProperties": {"type": "null"}},
            **_TRUNCATING,
        },
    },
    {
        "anyOf": [
            {"type": "array", "items": _PREDICTION},
            {"type": "array", "items": {"type": "array", "items": _PREDICTION}},
        ]
    },
)
TOKENIZE = _tei(
    "Text Embeddings Inference's tokenize: each text's tokens, from the model's tokenizer",
    {
        "title": "TokenizeRequest",
        "type": "object",
        "required": ["inputs"],
        "additionalProperties": False,
        "properties": {
            "inputs": _TEXTS,
            "add_special_tokens": _FLAG,
            "prompt_name": {"type": "null"},
            "model": _MODEL,
        },
    },
    {"type": "array", "items": {"type": "array", "items": _TOKEN}},
)
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}}
DECODE = _tei(
    "Text Embeddings Inference's decode: token ids back to text",
    {
        "title": "DecodeRequest",
        "type": "object",
        "required": ["ids"],
        "additionalProperties": False,
        "properties": {
            "ids": {"anyOf": [_IDS, {"type": "array", "items": _IDS, "minItems": 1}]},
            "skip_special_tokens": _FLAG,
            "model": _MODEL,
        },
    },
    {"type": "array", "items": {"type": "string"}},
)
INFO = Operation(
    summary="Text Embeddings Inference's info: a model's kind, labels and longest input",
    tag="retrieval",
    parameters=(
        {
            "name": "model",
            "in": "query",
            "schema": {"type": "string"},
            "description": "needed where several models serve these routes",
        },
    ),
    answers={
        200: json_answer(
            "the model's info",
            {
                "type": "object",
                "required": [
                    "model_id",
                    "model_type",
                    "max_input_length",
                    "max_client_batch_size",
                    "version",
                ],
            },
        ),
        **errors(400, 401, 404, 503, schema=TEI_ERROR),
    },
    auth="key",
)
COHERE_RERANK = Operation(
    summary="Cohere's and Jina's rerank: documents scored against the query, best first",
    tag="retrieval",
    description=_RULES,
    parameters=(REQUEST_ID,),
    body={
        "title": "CohereRerankRequest",
        "type": "object",
        "required": ["query", "documents"],
        "additionalProperties": False,
        "properties": {
            "model": _MODEL,
            "query": {"type": "string", "minLength": 1},
            "documents": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "anyOf": [
                        {"type": "string"},
                        {
                            "type": "object",
                            "required": ["text"],
                            "properties": {"text": {"type": "string"}},
                        },
                    ]
                },
            },
            "top_n": {"type": ["integer", "null"], "minimum": 1},
            "return_documents": _FLAG,
            "max_chunks_per_doc": {},
            "rank_fields": {},
            "truncate": {
                "enum": ["NONE", "END", None],
                "description": "NONE: a pair over the model's length is 413",
            },
        },
    },
    answers={
        200: json_answer(
            "the ranks",
            {
                "type": "object",
                "required": ["id", "results"],
                "properties": {
                    "id": {"type": "string"},
                    "results": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["index", "relevance_score"],
                            "properties": {
                                "index": {"type": "integer"},
                                "relevance_score": {"type": "number"},
                            },
                        },
                    },
                },
            },
        ),
        **errors(400, 401, 404, 413, 429, 500, 503, 504),
    },
    auth="key",
)
OPERATIONS = {
    ("POST", "/embed"): EMBED,
    ("POST", "/rerank"): RERANK,
    ("POST", "/predict"): PREDICT,
    ("POST", "/v1/rerank"): COHERE_RERANK,
    ("POST", "/v2/rerank"): COHERE_RERANK,
    ("POST", "/tokenize"): TOKENIZE,
    ("POST", "/decode"): DECODE,
    ("GET", "/info"): INFO,
}
