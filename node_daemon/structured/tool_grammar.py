"""The grammar of a forced tool call (tool_choice "required" or a named function), in the family's own format.

The calls are generated in exactly the text the family's parser reads (text/tool_calls/formats.py), each
under the schema of the function it names, so even a small model returns calls that parse and validate.
A marker that is a special token of the tokenizer is written as that token (`<[id]>`), not as its text.
"""
from __future__ import annotations

import json
from typing import Callable

from stallfree.node_daemon.structured.grammar import Grammar, compact, lark_grammar
from stallfree.node_daemon.text.tool_calls.schema import ForcedToolCalls


def _literal(text: str, special_id: Callable[[str], int | None] | None) -> str:
    token = special_id(text) if special_id else None
    return f"<[{token}]>" if token is not None else json.dumps(text)


def tool_call_grammar(forced: ForcedToolCalls, special_id: Callable[[str], int | None] | None = None) -> Grammar:
    """`special_id(text)` is the id of the special token spelled `text`, or None (the server passes the
    tokenizer's lookup restricted to special tokens)."""
    fmt = forced.format
    origin = f"tool_calls:{fmt.name}"
    if fmt.array:
        body = f"%json {json.dumps(compact(forced.calls_schema()))}"
        lines = [f"start: {_literal(fmt.markers[0], special_id)} calls", f"calls: {body}"]
        return lark_grammar("\n".join(lines), origin)
    call = "body"
    if fmt.call_close:  # hermes: each call in its own <tool_call> block
        call = f"{_literal(fmt.markers[0], special_id)} \"\\n\" body \"\\n\" {_literal(fmt.call_close, special_id)}"
    repeat = f" ({json.dumps(fmt.separator)} call)*" if forced.parallel else ""
    lines = [f"start: call{repeat}", f"call: {call}", f"body: %json {json.dumps(compact(forced.call_schema))}"]
    return lark_grammar("\n".join(lines), origin)
