"""A chat answer with tools, whole or in deltas, and the OpenAPI schemas of the fields that
structured output and tool calls add to the OpenAI-shaped routes."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidInput
from ..models.grammar import Constraint
from .structured import SCHEMA
from .tool_calls import MAX_TOOLS, ToolStream


def one_constraint(asked: Constraint | None, tools: Constraint | None) -> Constraint | None:
    """A structured output field's constraint or the tools', never both: one grammar holds an
    answer."""
    if asked is not None and tools is not None:
        raise InvalidInput(
            f'"{asked.field}" and "tools" (with "tool_choice" other than "none") each constrain'
            " the answer; give one"
        )
    return asked or tools


class ChatShape:
    """A chat answer's message: its text as content, or (where the tools' grammar holds
    the answer) its calls read out as `tool_calls`."""

    def __init__(self, reads_calls: bool) -> None:
        self._stream = ToolStream() if reads_calls else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._stream is None:
            return [{"content": text}] if text else []
        return self._stream.feed(text)

    def flush(self, *, cut: bool) -> list[dict[str, Any]]:
        """What is held back, at the end (`cut`: by `max_tokens`)."""
        return [] if self._stream is None else self._stream.flush(cut=cut)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's `tool_calls` where the model ended after calling."""
        if self._stream is not None and self._stream.calls and reason == "stop":
            return "tool_calls"
        return reason

    def whole(self, output: str, reason: str | None) -> dict[str, Any]:
        """The choice's `message` and `finish_reason`."""
        if self._stream is None:
            message: dict[str, Any] = {"role": "assistant", "content": output}
        else:
            self._stream.feed(output)
            self._stream.flush(cut=reason == "length")
            calls = self._stream.calls
            content = self._stream.content
            message = {"role": "assistant", "content": content or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
        return {"message": message, "finish_reason": self.finish_reason(reason)}


_TEXT_PART = {
    "type": "object",
    "required": ["text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_CALL = {
    "type": "object",
    "required": ["id", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string"},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": _TEXT_PART},
                {"type": "null", "description": "only an assistant message with tool_calls"},
            ]
        },
        "tool_calls": {"type": "array", "items": _CALL},
        "tool_call_id": {"type": "string", "description": "a tool message: the call it answers"},
    },
}
_FUNCTION = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": SCHEMA,
                "strict": {"type": ["boolean", "null"]},
            },
        },
    },
}
CHAT_SCHEMAS: dict[str, Any] = {
    "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS, "items": _FUNCTION},
    "tool_choice": {
        "anyOf": [
            {"enum": ["none", "auto", "required", None]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    },
                },
            },
        ]
    },
}
