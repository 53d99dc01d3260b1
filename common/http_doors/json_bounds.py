"""How much structure a JSON body may hold, checked on the raw bytes before anything parses it.

Parsing and validating a body is one C call each (json.loads, pydantic) that holds the GIL however many
values it holds, and no worker thread helps while the event loop and the engine wait for it (docs/serving.md
has the stalls). So a body may hold at most MAX_JSON_VALUES values (commas outside strings), MAX_JSON_MEMBERS
object members (colons) and MAX_JSON_OBJECTS objects (opening braces): within these, a parse is short.
A token-id prompt longer than the context is refused anyway; OpenAI allows 2048 chat messages.

Counting the raw bytes is one fast C pass each; only when a count is over its bound (the delimiters may sit
inside strings: a CSV prompt holds many commas) are the strings skipped, 64 KiB at a time so that no step
holds the GIL for long, stopping as soon as a bound is passed.
"""
from __future__ import annotations

# 131072: a token-id prompt for a 128k context; longer prompts go as text.
MAX_JSON_VALUES = 1 << 17
MAX_JSON_MEMBERS = 1 << 16
MAX_JSON_OBJECTS = 1 << 14  # 16384: 2048 messages of several content parts each

_BOUNDS = ((b",", MAX_JSON_VALUES, "values"), (b":", MAX_JSON_MEMBERS, "object members"),
           (b"{", MAX_JSON_OBJECTS, "objects"))


class TooManyValues(ValueError):
    """The body holds more JSON structure than a request may."""


def within_bounds_at_a_glance(raw: bytes) -> bool:
    """True when the raw counts alone show `raw` within the bounds (else check_bounds skips strings: slower)."""
    return all(raw.count(char) <= limit for char, limit, _ in _BOUNDS)


def check_bounds(raw: bytes) -> None:
    """Raise TooManyValues if `raw`, read as JSON, holds more values, members or objects than allowed."""
    over = [(char, limit, what) for char, limit, what in _BOUNDS if raw.count(char) > limit]
    if not over:
        return
    counts = dict.fromkeys((char for char, _, _ in over), 0)
    for outside in _outside_strings(raw):
        for char, limit, what in over:
            counts[char] += outside.count(char)
            if counts[char] > limit:
                raise TooManyValues(f"the JSON body holds more than {limit} {what}: send at most that many "
                                    f"(a prompt of token ids must fit the context, and a chat at most 2048 "
                                    f"messages)")


def _outside_strings(raw: bytes, window: int = 1 << 16):
    """What lies outside the JSON strings of `raw`, a window at a time (each step a few short C calls).

    Escaped backslashes, then escaped quotes, are blanked first (left to right, as a JSON parser reads them);
    every quote left then opens or closes a string, so alternate pieces between quotes are outside."""
    cleaned = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    inside = False
    for start in range(0, len(cleaned), window):
        pieces = cleaned[start:start + window].split(b'"')
        yield b"".join(pieces[1 if inside else 0::2])
        inside ^= len(pieces) % 2 == 0  # an odd number of quotes in the window
