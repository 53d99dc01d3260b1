"""json_bounds: a body's values, members and objects counted before parsing, strings skipped exactly."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.http_doors.json_bounds import (MAX_JSON_OBJECTS, MAX_JSON_VALUES, TooManyValues,
                                                       _outside_strings, check_bounds)

# Strings full of the characters the scan must not be fooled by: quotes, backslashes, delimiters.
tricky = st.text(alphabet='ab,:{}[]"\\\n é', max_size=12)
documents = st.recursive(st.none() | st.integers() | tricky,
                         lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky, inner, max_size=4),
                         max_leaves=20)


def _outside_by_hand(raw: str) -> str:
    """What lies outside JSON strings, by a character-by-character state machine."""
    out, inside, escaped = [], False, False
    for char in raw:
        if inside:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                inside = False
        elif char == '"':
            inside = True
        else:
            out.append(char)
    return "".join(out)


@settings(max_examples=300, deadline=None)
@given(doc=documents, ascii_only=st.booleans())
def test_the_scan_skips_exactly_the_strings(doc, ascii_only):
    raw = json.dumps(doc, ensure_ascii=ascii_only).encode()
    for window in (1, 7, 1 << 16):  # windows cut anywhere: inside strings, escapes, multi-byte characters
        outside = b"".join(_outside_strings(raw, window))
        assert outside.decode() == _outside_by_hand(raw.decode())


def test_values_are_bounded_and_commas_in_strings_do_not_count():
    check_bounds(json.dumps([0] * MAX_JSON_VALUES).encode())  # MAX_JSON_VALUES - 1 commas
    check_bounds(json.dumps({"prompt": "a," * (2 * MAX_JSON_VALUES)}).encode())
    with pytest.raises(TooManyValues, match="values"):
        check_bounds(json.dumps([0] * (MAX_JSON_VALUES + 2)).encode())


def test_objects_are_bounded_and_braces_in_strings_do_not_count():
    check_bounds(json.dumps([{}] * MAX_JSON_OBJECTS).encode())
    check_bounds(json.dumps(["{\\\"{"] * MAX_JSON_OBJECTS * 2).encode())
    with pytest.raises(TooManyValues, match="objects"):
        check_bounds(json.dumps([{}] * (MAX_JSON_OBJECTS + 1)).encode())
