"""Tool calls on `/v1/chat/completions`: `tools` and `tool_choice` read, the chat's history
of calls and results checked, and the model's calls read out of its text into
`message.tool_calls`, whole or as OpenAI streams them (a call's id and name, then its
arguments in pieces).

Calls are written in the Hermes format (`models/chat_tools.py`); every choice but `none` is
held to it by a grammar: `required` and a named function make the answer exactly one call
(valid JSON for that function's parameters), `auto` lets the model write text, and any call
it opens with `<tool_call>` must be a whole, valid call of a listed function (with
`parallel_tool_calls: false`, the answer ends after its first call). `none` shows the tools
to the model and reads no calls.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

import orjson

from ..errors import InvalidInput
from ..models.grammar import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Constraint,
    GrammarKind,
    GrammarSpec,
)
from .structured import json_schema_text

MAX_TOOLS = 128
"""OpenAI's own limit on tools a request."""
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class Tools(NamedTuple):
    """A chat's tools, as the template is given them, and what the answer does with them."""

    listed: list[dict[str, Any]] | None
    """The tools in OpenAI's shape (None: none given)."""
    constraint: Constraint | None
    """The grammar that holds the answer to the choice (None: `none`, or no tools)."""

    @property
    def reads_calls(self) -> bool:
        return self.constraint is not None


def read_tools(payload: Mapping[str, Any]) -> Tools:
    """`tools` and `tool_choice` checked; InvalidInput naming the field otherwise."""
    given = payload.get("tools")
    choice = payload.get("tool_choice")
    parallel = payload.get("parallel_tool_calls")
    if given is None or given == []:
        if choice not in (None, "none", "auto"):
            raise InvalidInput(f'"tool_choice" {_brief(choice)} needs "tools"')
        return Tools(None, None)
    if not isinstance(given, list) or len(given) > MAX_TOOLS:
        raise InvalidInput(f'"tools" must be a list of at most {MAX_TOOLS} tools')
    listed: list[dict[str, Any]] = []
    functions: list[dict[str, Any]] = []
    for index, tool in enumerate(given):
        name, parameters = _function(tool, f"tools[{index}]")
        if any(f["name"] == name for f in functions):
            raise InvalidInput(f'"tools[{index}]": a second function named {name}')
        functions.append({"name": name, "parameters": parameters})
        listed.append(tool)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return Tools(listed, None)
    if choice == "auto":
        # One call at most where the client says so: the answer ends after it.
        kind: GrammarKind = "tool_auto_one" if parallel is False else "tool_auto"
        return Tools(listed, _tools_constraint(kind, functions, "tools"))
    if choice == "required":  # exactly one call
        return Tools(listed, _tools_constraint("tool_call", functions, "tools"))
    named = _named(choice)
    for index, function in enumerate(functions):
        if function["name"] == named:
            field = f"tools[{index}].function.parameters"
            return Tools(listed, _tools_constraint("tool_call", [function], field))
    raise InvalidInput(f'"tool_choice" names {named}, which is not among "tools"')


def read_messages(given: object) -> list[dict[str, Any]]:
    """A chat's messages: each a role and its text (content parts of type text joined), an
    assistant's earlier `tool_calls`, and a tool's result, whose `tool_call_id` must answer
    a call made before it."""
    if not isinstance(given, list) or not given:
        raise InvalidInput('"messages" must be a non-empty list')
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    for index, message in enumerate(given):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidInput('each message needs a string "role" and text "content"')
        role = message["role"]
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        content = _content(message.get("content"), optional=bool(tool_calls))
        read: dict[str, Any] = {"role": role, "content": content}
        if tool_calls:
            read["tool_calls"] = _history_calls(tool_calls, f"messages[{index}].tool_calls")
            calls.update(call["id"] for call in read["tool_calls"])
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise InvalidInput(
                    f'"messages[{index}].tool_call_id" {_brief(call_id)} answers no tool call'
                    " made in an earlier assistant message"
                )
            read["tool_call_id"] = call_id
        messages.append(read)
    return messages


class ToolStream:
    """Reads the model's text as it comes: content until a call opens, then the call, as
    OpenAI's deltas (`{"content"}` or `{"tool_calls": [...]}`). The grammar writes each call
    as `<tool_call>\\n{"name": "...", "arguments": ARGS}\\n</tool_call>`."""

    _HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')
    _TAIL = "}" + TOOL_CALL_CLOSE

    def __init__(self) -> None:
        self._text = ""
        self._in_call = False
        self._named = False
        self.calls: list[dict[str, Any]] = []
        """The calls read so far, whole or begun, in OpenAI's `tool_calls` shape."""
        self.content = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        deltas: list[dict[str, Any]] = []
        while True:
            state = (self._in_call, self._named, len(self._text))
            delta = self._call_delta() if self._in_call else self._content_delta()
            if delta is not None:
                deltas.append(delta)
            elif state == (self._in_call, self._named, len(self._text)):
                return deltas

    def flush(self, *, cut: bool = False) -> list[dict[str, Any]]:
        """What is held back, at the end: a call cut short keeps the arguments it has. Where
        `max_tokens` cut the answer (`cut`), the start of a call's tags is dropped, named or
        not yet: the grammar's tags are not the model's text."""
        rest, self._text = self._text, ""
        if not rest:
            return []
        if not self._in_call:
            if cut and TOOL_CALL_OPEN.startswith(rest):
                return []
            self.content += rest
            return [{"content": rest}]
        if not self._named:
            return []
        # Cut inside the closing tags: their start is not the arguments'.
        args = rest[: len(rest) - _prefix_kept(rest, self._TAIL)]
        return [self._arguments(args)] if args else []

    def _content_delta(self) -> dict[str, Any] | None:
        opening = self._text.find(TOOL_CALL_OPEN)
        if opening >= 0:
            self._in_call, self._named = True, False
            text, self._text = self._text[:opening], self._text[opening + len(TOOL_CALL_OPEN) :]
            self.content += text
            return {"content": text} if text else None
        keep = _prefix_kept(self._text, TOOL_CALL_OPEN)
        text, self._text = (
            self._text[: len(self._text) - keep],
            self._text[len(self._text) - keep :],
        )
        self.content += text
        return {"content": text} if text else None

    def _call_delta(self) -> dict[str, Any] | None:
        if not self._named:
            head = self._HEAD.match(self._text)
            if head is None:
                return None
            self._named = True
            self._text = self._text[head.end() :]
            call = {
                "index": len(self.calls),
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": orjson.loads(head.group(1)), "arguments": ""},
            }
            self.calls.append(call)
            return {"tool_calls": [orjson.loads(orjson.dumps(call))]}
        ending = self._text.find(self._TAIL)
        if ending >= 0:
            args, self._text = self._text[:ending], self._text[ending + len(self._TAIL) :]
            self._in_call = False
            return self._arguments(args) if args else None
        keep = min(len(self._text), len(self._TAIL) - 1)
        args, self._text = (
            self._text[: len(self._text) - keep],
            self._text[len(self._text) - keep :],
        )
        return self._arguments(args) if args else None

    def _arguments(self, text: str) -> dict[str, Any]:
        call = self.calls[-1]
        call["function"]["arguments"] += text
        return {"tool_calls": [{"index": call["index"], "function": {"arguments": text}}]}


def _prefix_kept(text: str, tag: str) -> int:
    """The longest end of `text` that `tag` starts with (it may be the start of a call)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _function(tool: object, field: str) -> tuple[str, Any]:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if (
        not isinstance(tool, Mapping)
        or tool.get("type") != "function"
        or not isinstance(function, Mapping)
    ):
        raise InvalidInput(f'"{field}" must be {{"type": "function", "function": {{...}}}}')
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidInput(f'"{field}.function.name" must be 1 to 64 letters, digits, _ or -')
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    json_schema_text(parameters, f"{field}.function.parameters")
    return name, parameters


def _tools_constraint(kind: GrammarKind, functions: list[dict[str, Any]], field: str) -> Constraint:
    return Constraint(GrammarSpec(kind, _json(functions)), field)


def _named(choice: object) -> str:
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if (
        not isinstance(choice, Mapping)
        or choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise InvalidInput(
            '"tool_choice" must be "none", "auto", "required" or'
            ' {"type": "function", "function": {"name": ...}}'
        )
    return name


def _content(content: object, *, optional: bool) -> str:
    if content is None and optional:
        return ""
    if isinstance(content, list):
        parts = [p.get("text") if isinstance(p, Mapping) else None for p in content]
        if not all(isinstance(p, str) for p in parts):
            raise InvalidInput("message content parts must be of type text")
        return "".join(parts)  # type: ignore[arg-type]
    if not isinstance(content, str):
        raise InvalidInput('each message needs a string "role" and text "content"')
    return content


def _history_calls(calls: object, field: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InvalidInput(f'"{field}" must be a list of calls')
    read = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if (
            not isinstance(call, Mapping)
            or not isinstance(call.get("id"), str)
            or not isinstance(function, Mapping)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise InvalidInput(
                f'"{field}[{index}]" must be {{"id", "type": "function", "function":'
                ' {"name", "arguments"}}'
            )
        named = {"name": function["name"], "arguments": function["arguments"]}
        read.append({"id": call["id"], "type": "function", "function": named})
    return read


def _json(value: object) -> str:
    return orjson.dumps(value).decode()


def _brief(value: object) -> str:
    return _json(value)[:80]
