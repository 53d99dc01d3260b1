"""The model's text -> content and OpenAI tool calls, whole or as a stream of deltas.

One streaming state machine serves both: parse_tool_calls() feeds it the whole text, so a stream's deltas
always add up to what the non-streamed answer returns. Text outside the family's call markers is content;
each call's name is sent once, in the call's first delta (with its id and type), then its arguments as
they arrive: the exact JSON text the model wrote (a string value holding JSON is decoded first). Calls are
indexed 0, 1, ... as the openai client accumulates them. Text that opens like a call but is none (no name
before it ends or breaks) is given back as content.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

from stallfree.node_daemon.text.tool_calls.formats import ToolCallFormat

_ARGUMENT_KEYS = ("arguments", "parameters")
_SPACE = " \t\r\n"
_SEPARATORS = ",;[]"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ParsedDelta:
    """What one piece of model text adds: content text and tool-call deltas (OpenAI's `delta` fields)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class _Malformed(Exception):
    pass


class _Call:
    """The call object being read: its keys' state and what of it was sent."""

    def __init__(self) -> None:
        self.state = "key_or_end"  # key_or_end, key, colon, value_start, value
        self.key_raw = ""
        self.key = ""
        self.value_raw = ""
        self.value_kind = ""  # string, container, scalar
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.name: str | None = None
        self.arguments = ""  # the arguments text known so far
        self.arguments_done = False
        self.streams_arguments = False  # the current value is the arguments, sent as it grows
        self.sent_arguments = 0
        self.index = -1  # set once the name is sent


class ToolCallStreamParser:
    """feed() each new piece of text, finish() at the end; each returns a ParsedDelta."""

    def __init__(self, format: ToolCallFormat, new_id: Callable[[], str] = new_call_id) -> None:
        self.format = format
        self.new_id = new_id
        self._buffer = ""
        self._mode = "content"  # content, calls, call
        self._seen_content = False  # a non-space character was given as content (bare starts only open an output)
        self._region = ""  # raw text of the current calls region, given back as content if it holds no call
        self._region_calls = 0
        self._call: _Call | None = None
        self._num_calls = 0
        self._out = ParsedDelta()
        self._tokens = tuple(format.markers) + ((format.call_close,) if format.call_close else ()) + ("<tool_call>",)

    # ---- public

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        self._run(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        self._run(final=True)
        if self._mode == "content":
            self._content(self._buffer)
        elif self._region_calls == 0 and (self._call is None or self._call.index < 0):
            self._content(self._region + self._buffer)  # it never became a call
        elif self._mode == "calls" and self._buffer.strip():
            self._content(self._buffer)
        self._buffer, self._region, self._mode, self._call = "", "", "content", None
        return self._take()

    @property
    def num_calls(self) -> int:
        return self._num_calls

    # ---- the state machine

    def _run(self, final: bool) -> None:
        while self._buffer:
            if self._mode == "content":
                if not self._step_content(final):
                    return
            elif self._mode == "calls":
                if not self._step_calls(final):
                    return
            else:
                try:
                    self._step_call()
                except _Malformed:
                    self._give_back()

    def _step_content(self, final: bool) -> bool:
        buf = self._buffer
        at, marker = min(((buf.find(m), m) for m in self.format.markers if m in buf), default=(-1, ""))
        if at >= 0:
            self._content(buf[:at])
            self._open_region(marker, len(marker) + at, at)
            return True
        if self.format.bare_start and not self._seen_content:
            stripped = buf.lstrip(_SPACE)
            if not stripped and not final:
                return False  # only spaces so far: a bare start may follow
            if stripped.startswith(self.format.bare_start):
                if not final and any(m.startswith(stripped) for m in self.format.markers):
                    return False  # "[" may be the start of "[TOOL_CALLS]"
                self._open_region("", len(buf) - len(stripped), 0)
                return True
        keep = 0 if final else _partial_marker_suffix(buf, self.format.markers)
        self._content(buf[:len(buf) - keep])
        self._buffer = buf[len(buf) - keep:]
        return False

    def _open_region(self, marker: str, consumed: int, content_end: int) -> None:
        self._region = self._buffer[content_end:consumed]
        self._buffer = self._buffer[consumed:]
        self._region_calls = 0
        self._mode = "calls"

    def _step_calls(self, final: bool) -> bool:
        buf = self._buffer
        c = buf[0]
        if c in _SPACE or c in _SEPARATORS:
            self._consume(1)
            return True
        for token in self._tokens:
            if buf.startswith(token):
                self._consume(len(token))
                return True
            if token.startswith(buf) and not final:
                return False  # maybe a marker, wait for the rest
        if c == "{":
            self._consume(1)
            self._call = _Call()
            self._mode = "call"
            return True
        self._close_region()
        return True

    def _close_region(self) -> None:
        """Leave the calls for content; a region that held no call is content itself."""
        if self._region_calls == 0:
            self._content(self._region)
        self._region, self._mode, self._call = "", "content", None

    def _give_back(self) -> None:
        """The call being read is no call: before any call of its region was sent, the region is content."""
        call = self._call
        if self._region_calls == 0 and (call is None or call.index < 0):
            self._content(self._region)
        self._region, self._mode, self._call = "", "content", None

    def _consume(self, n: int) -> str:
        taken, self._buffer = self._buffer[:n], self._buffer[n:]
        self._region += taken
        return taken

    def _step_call(self) -> None:
        call = self._call
        assert call is not None
        # Characters are read one at a time; a value's text is kept whole, the arguments also streamed.
        while self._buffer and self._mode == "call":
            c = self._buffer[0]
            state = call.state
            if state == "key_or_end":
                self._consume(1)
                if c in _SPACE or c == ",":
                    continue
                if c == '"':
                    call.state, call.key_raw, call.escaped = "key", "", False
                elif c == "}":
                    self._end_call()
                else:
                    raise _Malformed
            elif state == "key":
                self._consume(1)
                if c == '"' and not call.escaped:
                    call.key = _json_string('"' + call.key_raw + '"')
                    call.state = "colon"
                else:
                    call.escaped = c == "\\" and not call.escaped
                    call.key_raw += c
            elif state == "colon":
                self._consume(1)
                if c == ":":
                    call.state = "value_start"
                elif c not in _SPACE:
                    raise _Malformed
            elif state == "value_start":
                self._consume(1)
                if c in _SPACE:
                    continue
                call.value_raw, call.escaped = c, False
                call.value_kind = "string" if c == '"' else "container" if c in "{[" else "scalar"
                call.depth, call.in_string = (1, False) if c in "{[" else (0, c == '"')
                call.streams_arguments = call.key in _ARGUMENT_KEYS and call.value_kind == "container"
                call.state = "value"
            else:
                self._step_value(call, c)
        if call.streams_arguments and call.state == "value":
            call.arguments = call.value_raw
            self._send_arguments(call)

    def _step_value(self, call: _Call, c: str) -> None:
        kind = call.value_kind
        if kind == "scalar":
            if c in _SPACE or c in ",}":
                self._end_value(call)  # the character belongs to the object, not the value
                return
            call.value_raw += self._consume(1)
            return
        call.value_raw += self._consume(1)
        if call.escaped:
            call.escaped = False
        elif c == "\\" and (call.in_string or kind == "string"):
            call.escaped = True
        elif kind == "string":
            if c == '"':
                self._end_value(call)
        elif c == '"':
            call.in_string = not call.in_string
        elif not call.in_string and c in "{[":
            call.depth += 1
        elif not call.in_string and c in "}]":
            call.depth -= 1
            if call.depth == 0:
                self._end_value(call)

    def _end_value(self, call: _Call) -> None:
        call.state = "key_or_end"
        if call.key == "name":
            name = _json_value(call.value_raw)
            if not isinstance(name, str) or not name or call.name is not None:
                raise _Malformed
            call.name = name
            self._send_header(call)
        elif call.key in _ARGUMENT_KEYS and not call.arguments_done:
            if call.value_kind == "container":
                _json_value(call.value_raw)  # arguments that do not parse are no call
                call.arguments = call.value_raw
            else:
                value = _json_value(call.value_raw)
                call.arguments = value if isinstance(value, str) else json.dumps(value)
            call.streams_arguments = False
            call.arguments_done = True
            self._send_arguments(call)

    def _end_call(self) -> None:
        call = self._call
        assert call is not None
        if call.name is None:
            raise _Malformed
        if not call.arguments_done:
            call.arguments = call.arguments if call.arguments else "{}"  # a call without arguments takes none
            call.arguments_done = True
            self._send_arguments(call)
        self._region_calls += 1
        self._call = None
        self._mode = "calls"

    # ---- output

    def _send_header(self, call: _Call) -> None:
        call.index = self._num_calls
        self._num_calls += 1
        self._out.tool_calls.append({"index": call.index, "id": self.new_id(), "type": "function",
                                     "function": {"name": call.name, "arguments": ""}})
        self._send_arguments(call)

    def _send_arguments(self, call: _Call) -> None:
        if call.index < 0 or len(call.arguments) <= call.sent_arguments:
            return
        fragment = call.arguments[call.sent_arguments:]
        call.sent_arguments = len(call.arguments)
        last = self._out.tool_calls[-1] if self._out.tool_calls else None
        if last is not None and last["index"] == call.index:
            last.setdefault("function", {})
            last["function"]["arguments"] = last["function"].get("arguments", "") + fragment
        else:
            self._out.tool_calls.append({"index": call.index, "function": {"arguments": fragment}})

    def _content(self, text: str) -> None:
        if text:
            self._out.content += text
            if text.strip(_SPACE):
                self._seen_content = True

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out


def _json_string(raw: str) -> str:
    try:
        return json.loads(raw)
    except ValueError:
        raise _Malformed from None


def _json_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise _Malformed from None


def _partial_marker_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that could begin a marker (held back until it is known)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


def accumulate_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deltas -> whole calls, as the openai client merges them (by index; strings concatenated)."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if delta.get("id"):
            call["id"] = delta["id"]
        fn = delta.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def parse_tool_calls(text: str, format: ToolCallFormat,
                     new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output; content is None when the output is only calls (and spaces)."""
    parser = ToolCallStreamParser(format, new_id)
    parts = [parser.feed(text), parser.finish()]
    content = "".join(p.content for p in parts)
    calls = accumulate_tool_calls([d for p in parts for d in p.tool_calls])
    if calls and not content.strip():
        return None, calls
    return content, calls
