"""The JSON Schema a forced tool call is generated under (tool_choice "required" or a named function).

One call is an object {"name": <const>, <arguments key>: <that function's parameters schema>}; with several
tools it is an anyOf of those objects, so the arguments always match the function named. The family's
format (formats.py) says the arguments key and how calls are wrapped; structured/ turns it into a grammar.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from stallfree.node_daemon.text.tool_calls.formats import ToolCallFormat
from stallfree.node_daemon.text.tool_calls.tools import Tool, ToolChoice


def call_schema(tools: Sequence[Tool], arguments_key: str = "arguments") -> dict[str, Any]:
    """The schema of one call to any of `tools`."""
    if not tools:
        raise ValueError("a tool call schema needs at least one tool")
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, arguments_key: t.parameters},
                "required": ["name", arguments_key], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


@dataclass(frozen=True)
class ForcedToolCalls:
    """What a forced request must generate: one call (or several when `parallel`), in `format`'s wrapping."""

    format: ToolCallFormat
    call_schema: dict[str, Any]
    parallel: bool

    def calls_schema(self) -> dict[str, Any]:
        """For array formats (mistral): the schema of the whole array of calls."""
        schema: dict[str, Any] = {"type": "array", "items": self.call_schema, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def forced_tool_calls(choice: ToolChoice, format: ToolCallFormat) -> ForcedToolCalls | None:
    """The constraint for a request's tool_choice, or None when the model chooses freely (none, auto)."""
    if not choice.forces_call:
        return None
    # A named function is called once (as OpenAI answers it); "required" may make several calls when parallel.
    parallel = choice.parallel and choice.mode == "required"
    return ForcedToolCalls(format, call_schema(choice.tools, format.arguments_key), parallel)
