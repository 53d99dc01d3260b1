"""Older spellings of what `tools` and `response_format` ask for: translated, or refused by name, never ignored.

OpenAI's deprecated `functions`/`function_call` are served as `tools`/`tool_choice` (the translations below). vLLM's
`guided_*` extensions would otherwise fall under "unknown fields are ignored" and be answered 200 with plain text,
as if the request had been honoured: each row of REFUSED is one field and its refusal.
"""
from __future__ import annotations

from typing import Any

REFUSED: dict[str, str] = {
    "guided_json": "`guided_json` (vLLM's extension) is not supported: send `response_format` "
                   "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}} instead",
    "guided_regex": "`guided_regex` (vLLM's extension) is not supported: constrained output is asked for with "
                    "`response_format`",
    "guided_choice": "`guided_choice` (vLLM's extension) is not supported: send `response_format` with a JSON "
                     "schema whose `enum` lists the choices",
    "guided_grammar": "`guided_grammar` (vLLM's extension) is not supported: constrained output is asked for with "
                      "`response_format`",
}


def tools_from_functions(functions: Any) -> list[Any] | None:
    """OpenAI's deprecated `functions` ([{name, description, parameters}]) as `tools`; None when not sent.
    Items that are not objects are passed on as they are, for tools' own check to name."""
    if functions in (None, [], {}, ""):
        return None
    if not isinstance(functions, list):
        return functions  # refused by parse_tools, naming tools
    return [{"type": "function", "function": f} if isinstance(f, dict) else f for f in functions]


def tool_choice_from_function_call(function_call: Any) -> Any:
    """OpenAI's deprecated `function_call` ("none", "auto" or {"name": ...}) as `tool_choice`; None when not sent."""
    if function_call in (None, {}, ""):
        return None
    if isinstance(function_call, dict) and "name" in function_call:
        return {"type": "function", "function": {"name": function_call["name"]}}
    return function_call


def refused_field(values: dict[str, Any]) -> tuple[str, str] | None:
    """(param, message) for the first legacy field sent with a value (null and empty count as absent), else None."""
    for name, message in REFUSED.items():
        if values.get(name) not in (None, [], {}, ""):
            return name, message
    return None
