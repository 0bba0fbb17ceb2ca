"""A chat with tools as one prompt: the model's own chat template where it has a tools
section (transformers' `apply_chat_template(tools=...)`), else the fallback written here.

The fallback (a template that never mentions `tools`, or none at all) lists the tools in a
system message and asks for calls in the Hermes format, which Qwen's and Hermes' own
templates use too, so that one parser reads every answer (`doors/tool_calls.py`):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

An earlier assistant turn's calls are written back the same way, and a tool's result as a
user turn between `<tool_response>` tags (a user turn, because some templates refuse a role
they do not know; the results of parallel calls share one, because some refuse two user
turns in a row).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidInput
from .grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

TOOLS_PREAMBLE = (
    "You may call functions to help with the user's request. The functions, as JSON"
    " schemas:\n<tools>\n{tools}\n</tools>\nTo call one, answer with its name and arguments"
    " as a JSON object between tags, one call per pair:\n"
    + TOOL_CALL_OPEN
    + '{{"name": "<function name>", "arguments": {{<its arguments>}}}}'
    + TOOL_CALL_CLOSE
)


def templated_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    """`messages` (OpenAI's shape) as one prompt in the tokenizer's chat template, with
    `tools` in its tools section or else the fallback; the plain template without one.
    InvalidInput (400) where the template refuses the chat (a template may raise on turns
    it does not allow: roles out of order, a system message it has no place for)."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return plain_chat_prompt(messages, tools)
    from jinja2 import TemplateError, TemplateSyntaxError  # transformers renders with jinja2

    with_tools = bool(tools) and "tools" in template
    turns = template_messages(messages) if with_tools else fallback_messages(messages, tools)
    try:
        text: str = tokenizer.apply_chat_template(
            turns, tools=tools if with_tools else None, tokenize=False, add_generation_prompt=True
        )
    except TemplateSyntaxError:
        raise  # the template itself is broken: the server's fault, not the messages'
    except TemplateError as exc:
        raise InvalidInput(f"the model's chat template refused these messages: {exc}") from None
    return text


def plain_chat_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    """A chat as one prompt, for generators without a template of their own."""
    turns = "".join(
        f"<|{m['role']}|>\n{m['content']}\n" for m in fallback_messages(messages, tools)
    )
    return turns + "<|assistant|>\n"


def fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, str]]:
    """The chat as plain (role, text) turns: the tools listed in the system message, calls
    and results written as text."""
    turns: list[dict[str, str]] = []
    after_results = False
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
            if after_results:
                # Parallel calls' results as one user turn: templates that make roles
                # alternate refuse two user turns in a row.
                turns[-1]["content"] += "\n" + content
                continue
            role = "user"
        after_results = message["role"] == "tool"
        calls = message.get("tool_calls") or []
        written = [TOOL_CALL_OPEN + _call_json(call) + TOOL_CALL_CLOSE for call in calls]
        turns.append({"role": role, "content": "\n".join(filter(None, [content, *written]))})
    if not tools:
        return turns
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    preamble = TOOLS_PREAMBLE.format(tools=listed)
    if turns and turns[0]["role"] == "system":
        return [{"role": "system", "content": turns[0]["content"] + "\n\n" + preamble}, *turns[1:]]
    return [{"role": "system", "content": preamble}, *turns]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages as chat templates read them: a call's arguments as an object,
    not the JSON text OpenAI sends."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {
                **message,
                "content": message.get("content") or "",
                "tool_calls": [
                    {**call, "function": {**call["function"], "arguments": _arguments(call)}}
                    for call in calls
                ],
            }
        out.append(message)
    return out


def _arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["function"]["arguments"])
    except ValueError:
        return call["function"]["arguments"]


def _call_json(call: dict[str, Any]) -> str:
    function = call["function"]
    return json.dumps({"name": function["name"], "arguments": _arguments(call)}, ensure_ascii=False)
