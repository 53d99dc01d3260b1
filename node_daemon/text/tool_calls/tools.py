"""OpenAI's `tools` and `tool_choice`, checked: which functions the model may call and whether it must.

Errors are ValueErrors that say what is wrong with the request (the API answers 400).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# OpenAI's default for a function without `parameters`: an object with no properties declared.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    description: str = ""


@dataclass(frozen=True)
class ToolChoice:
    """What the model may do: "none" (answer in text), "auto" (text or calls), "required" (one call at
    least, to any of `tools`), or a named function (then `tools` holds that one only)."""

    mode: str  # "none" | "auto" | "required" | "function"
    tools: tuple[Tool, ...]
    parallel: bool = True

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "function")


def parse_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[Tool]:
    if tools is None:
        return []
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ValueError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        parameters = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        out.append(Tool(name, dict(parameters), description))
    names = [t.name for t in out]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"tools name the same function twice: {', '.join(duplicated)}")
    return out


def parse_tool_choice(tools: Sequence[Tool], tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> ToolChoice:
    """OpenAI's defaults: "auto" when tools are given, "none" when not; parallel calls allowed."""
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not isinstance(parallel, bool):
        raise ValueError("parallel_tool_calls must be true or false")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice {tool_choice!r} is not one of none, auto, required or a named function")
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return ToolChoice(tool_choice, tuple(tools), parallel)
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        chosen = [t for t in tools if t.name == name]
        if not chosen:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
        return ToolChoice("function", tuple(chosen), parallel)
    raise ValueError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
