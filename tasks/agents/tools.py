"""Tools: plain Python functions in the user's file or module, as TRL and verl take them.

A tool's JSON schema comes from its signature and docstring through transformers' `get_json_schema` (type hints on
every argument, a Google-style docstring with an `Args:` section); it goes to the chat template's `tools=`.

A call runs contained: its arguments are checked against the signature, it runs under a timeout, and anything but a
string back is refused. Whatever goes wrong becomes an error observation, the text the model sees as the tool's
result, and an error column in the turns table; the rollout goes on.
Imports: transformers inside `load_tool` (see there).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass
from typing import Callable

from schemas.errors import RewardLoadError
from tasks.agents.contained import contained
from tasks.rewards.loader import FunctionSpec, load_function


class ToolLoadError(RewardLoadError):
    """A tool that cannot be loaded or described: one line naming it."""


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass(frozen=True)
class Observation:
    """What one call gave back: `text` is what the model sees; `error` is None unless the call failed."""

    text: str
    error: str | None
    seconds: float


def tool_specs(agent) -> list[FunctionSpec]:
    """The agent section's tools (`AgentConfig.tools`), as the loaders take them."""
    return [FunctionSpec(name, t.path, t.module, t.function, kind="tool") for name, t in agent.tools.items()]


def load_tool(spec: FunctionSpec) -> Tool:
    """The tool a spec names (`path` or `module`, and `function`, defaulting to its name), with its schema."""
    # transformers (0.9 s of imports) only in the processes that describe tools, and only in runs that have some.
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        fn = load_function(dataclasses.replace(spec, kind="tool"))
    except RewardLoadError as exc:  # the reward functions' loader, whose errors already name the tool
        raise ToolLoadError(str(exc)) from None
    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as exc:
        raise ToolLoadError(f"tool {spec.name!r} ({spec.where}): {exc}".splitlines()[0]) from None
    # The model calls it by the configured name, which may differ from the function's.
    schema = {**schema, "function": {**schema["function"], "name": spec.name}}
    return Tool(spec.name, fn, schema)


def load_tools(specs: list[FunctionSpec]) -> dict[str, Tool]:
    names = [s.name for s in specs]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise ToolLoadError(f"tool {duplicate!r} is listed twice")
    return {s.name: load_tool(s) for s in specs}


def call_tool(tools: dict[str, Tool], name: str, arguments: dict, timeout_s: float) -> Observation:
    """Run one call. An unknown tool, arguments the signature does not take, an exception, a hang past `timeout_s`
    or a result that is not a string: an error observation naming what went wrong (the timeout: contained.py)."""
    started = time.perf_counter()

    def failed(error: str) -> Observation:
        return Observation(f"error: {error}", error, time.perf_counter() - started)

    tool = tools.get(name)
    if tool is None:
        return failed(f"no tool named {name!r} (tools: {', '.join(sorted(tools)) or 'none'})")
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as exc:
        return failed(f"{name}: {exc}")
    result, error = contained(lambda: tool.fn(**arguments), timeout_s, name)
    if error:
        return failed(error)
    if not isinstance(result, str):
        return failed(f"{name} returned {type(result).__name__} {str(result)[:40]!r}, not a string")
    return Observation(result, None, time.perf_counter() - started)
