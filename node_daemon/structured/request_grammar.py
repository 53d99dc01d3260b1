"""The one grammar a request decodes under, from its response_format and tool_choice together.

A forced tool call (tool_choice required or a named function) wins: the answer is the call, and the
response_format describes content there is none of. Otherwise response_format decides; with tool_choice
"auto" and a json_schema format, the content follows the schema and no call can be made (as in vLLM).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from stallfree.node_daemon.structured.grammar import Grammar, compile_response_format
from stallfree.node_daemon.structured.tool_grammar import tool_call_grammar
from stallfree.node_daemon.text.tokenizer import Tokenizer
from stallfree.node_daemon.text.tool_calls.formats import ToolCallFormat
from stallfree.node_daemon.text.tool_calls.schema import forced_tool_calls
from stallfree.node_daemon.text.tool_calls.tools import ToolChoice


def special_token_lookup(tokenizer: Tokenizer) -> Callable[[str], int | None]:
    """text -> the id of the special token spelled so ([TOOL_CALLS], <|python_tag|>), None for anything else."""
    return tokenizer.special_tokens().get


def request_grammar(response_format: Mapping[str, Any] | None, choice: ToolChoice | None, format: ToolCallFormat,
                    special_id: Callable[[str], int | None] | None = None) -> Grammar | None:
    """The request's grammar, or None when it decodes freely; ValueError (a 400) when a schema is refused."""
    forced = forced_tool_calls(choice, format) if choice is not None else None
    if forced is not None:
        return tool_call_grammar(forced, special_id)
    return compile_response_format(response_format)
