"""JSON a client must not send, refused before any route sees it; the parsed body for the route to reuse.

A body must hold at most json_bounds' values, members and objects (counted before parsing), nest at most
MAX_JSON_DEPTH deep, hold no lone UTF-16 surrogate in any string or key (`"\\ud800"` parses in Python but no
tokenizer or client can encode it), no NaN or Infinity, no float that overflows to infinity, and no integer
outside 64 bits. Bodies that are not JSON pass (NOT_JSON): the route gives its own 400 for them.
"""
from __future__ import annotations

import json
import math
from typing import Any

from stallfree.http_doors.json_bounds import TooManyValues, check_bounds

MAX_JSON_DEPTH = 32
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # int64 or uint64: what JSON clients can represent
# Every integer of 18 digits or fewer fits; only a body with a longer digit run has each integer checked as
# it is parsed (a Python call per integer: slow for a million token ids, which never have 19 digits).
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * 19

NOT_JSON = object()


class BodyRefused(ValueError):
    """The body is JSON a client must not send; `code` names why."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyRefused(f"the number {text[:40]} is out of range (non-finite)", "invalid_number")
    return value


def _parse_int(text: str) -> int:
    if len(text) > 21:  # cheaper than converting a 4000-digit number first
        raise BodyRefused(f"the integer {text[:24]}... does not fit in 64 bits", "invalid_number")
    value = int(text)
    if not _INT_MIN <= value <= _INT_MAX:
        raise BodyRefused(f"the integer {text} does not fit in 64 bits", "invalid_number")
    return value


def _refuse_constant(name: str) -> Any:
    raise BodyRefused(f"{name} is not a valid JSON number", "invalid_number")


def _check_text(value: str) -> None:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BodyRefused("a string holds a lone UTF-16 surrogate (such as \\ud800): send valid Unicode",
                              "invalid_unicode") from None


def check_json(raw: bytes) -> Any:
    """The parsed body, or NOT_JSON; raise BodyRefused for JSON a client must not send."""
    try:
        check_bounds(raw)
    except TooManyValues as exc:
        raise BodyRefused(str(exc), "too_many_values") from None
    parse_int = _parse_int if _LONG_DIGIT_RUN in raw.translate(_DIGITS_TO_ZERO) else None
    try:
        parsed = json.loads(raw, parse_float=_parse_float, parse_int=parse_int, parse_constant=_refuse_constant)
    except BodyRefused:
        raise
    except RecursionError:
        raise BodyRefused(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                          "invalid_json") from None
    except ValueError:
        return NOT_JSON  # not JSON (or not UTF-8): the route answers that itself
    stack: list[tuple[Any, int]] = [(parsed, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise BodyRefused(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                                  "invalid_json")
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key)
                    if isinstance(item, (str, list, dict)):
                        stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in value if isinstance(item, (str, list, dict)))
    return parsed
