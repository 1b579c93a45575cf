"""The model's tool calls, parsed in the format its chat template teaches (one registry entry per format).

- `hermes`: Hermes, Qwen2.5/Qwen3 and most chatml tool templates: each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` inside the assistant's turn.
- `json`: Llama 3.x's custom-tool form: the whole turn is one JSON object `{"name": ..., "parameters": {...}}` (or
  `"arguments"`), or a list of them.

A call that cannot be read (broken JSON, no name, arguments that are not an object) is still a call: it carries an
error, which the model sees as that call's result, so a malformed call is a counted mistake and not a silent stop.
Text without any call is the model's answer: the trajectory ends there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tasks.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str  # "" when it could not be read
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call could not be read
    raw: str = ""  # the call's text as the model wrote it


TOOL_CALL_PARSERS: Registry = Registry("tool-call format")


def _call_from(obj, raw: str, argument_keys: tuple[str, ...]) -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall("", error=f"a tool call must be a JSON object, not {type(obj).__name__}", raw=raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", error='a tool call needs a "name" string', raw=raw)
    key = next((k for k in argument_keys if k in obj), None)
    arguments = obj.get(key, {}) if key else {}
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return ToolCall(name, error=f"{name}: arguments are not JSON: {exc.msg}", raw=raw)
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f"{name}: arguments must be a JSON object", raw=raw)
    return ToolCall(name, arguments, raw=raw)


def _loads(raw: str, argument_keys: tuple[str, ...]) -> list[ToolCall]:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return [ToolCall("", error=f"the tool call is not JSON: {exc.msg} (at character {exc.pos})", raw=raw)]
    return [_call_from(o, raw, argument_keys) for o in (obj if isinstance(obj, list) else [obj])]


HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@TOOL_CALL_PARSERS.register("hermes")
def hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block, in order; one cut off by the token limit is read to the end."""
    return [call for m in HERMES_CALL.finditer(text) for call in _loads(m.group(1).strip(), ("arguments",))]


@TOOL_CALL_PARSERS.register("json")
def json_calls(text: str) -> list[ToolCall]:
    """The turn as one JSON call (or a list of calls), after an optional `<|python_tag|>`; other text is no call."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith(("{", "[")):
        return []
    return _loads(body, ("parameters", "arguments"))


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
    return TOOL_CALL_PARSERS.get(fmt)(text)
