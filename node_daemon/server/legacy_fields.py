"""Older spellings of what `tools` and `response_format` ask for: refused by name, never silently ignored.

OpenAI's deprecated `functions`/`function_call` and vLLM's `guided_*` extensions would otherwise fall under
"unknown fields are ignored" and be answered 200 with plain text, as if the request had been honoured. Each row
is one field and its refusal; to serve a field instead, drop its row and translate it where the request becomes
SamplingParams (protocol.py's `to_sampling_params`, or the chat request's tools).
"""
from __future__ import annotations

from typing import Any

CHAT_ONLY = frozenset({"functions", "function_call"})

REFUSED: dict[str, str] = {
    "functions": "`functions` (OpenAI's deprecated form of `tools`) is not supported: send `tools` instead, each "
                 "function as {\"type\": \"function\", \"function\": {...}}",
    "function_call": "`function_call` (OpenAI's deprecated form of `tool_choice`) is not supported: send "
                     "`tool_choice` with `tools` instead",
    "guided_json": "`guided_json` (vLLM's extension) is not supported: send `response_format` "
                   "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}} instead",
    "guided_regex": "`guided_regex` (vLLM's extension) is not supported: constrained output is asked for with "
                    "`response_format`",
    "guided_choice": "`guided_choice` (vLLM's extension) is not supported: send `response_format` with a JSON "
                     "schema whose `enum` lists the choices",
    "guided_grammar": "`guided_grammar` (vLLM's extension) is not supported: constrained output is asked for with "
                      "`response_format`",
}


def refused_field(values: dict[str, Any]) -> tuple[str, str] | None:
    """(param, message) for the first legacy field sent with a value (null and empty count as absent), else None."""
    for name, message in REFUSED.items():
        if values.get(name) not in (None, [], {}, ""):
            return name, message
    return None
