"""The engine's finish reasons as OpenAI's API spells them.

A grammar's dead end (structured/matcher.FINISH_GRAMMAR_DEAD_END: the output can go no further under its
grammar) has no reason of its own in OpenAI's API: it is "stop", with vLLM's `stop_reason` saying why. A choice
that made tool calls and stopped finishes "tool_calls".
"""
from __future__ import annotations

GRAMMAR_DEAD_END = "grammar_dead_end"  # the engine's RequestStatus value (engine/request.py)
NORMAL = frozenset({"stop", "length", GRAMMAR_DEAD_END})  # a request that finished with an answer


def api_reason(reason: str | None) -> str | None:
    return "stop" if reason == GRAMMAR_DEAD_END else reason


def with_calls(reason: str | None, made_calls: bool) -> str | None:
    """"tool_calls" for a choice that made calls and stopped (a call cut by max_tokens stays "length")."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def add_stop_reason(choice: dict, engine_reason: str | None) -> dict:
    """vLLM's stop_reason on a choice that ended at its grammar's dead end."""
    if engine_reason == GRAMMAR_DEAD_END:
        choice["stop_reason"] = GRAMMAR_DEAD_END
    return choice
