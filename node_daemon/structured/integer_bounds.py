"""Integers in generated JSON stay within 64 bits unless the schema says more.

A JSON Schema `{"type": "integer"}` admits integers of any length, and a small model that starts writing digits
may not stop until max_tokens (`"population": 1111222...`): the output is cut and does not parse. The daemon itself
accepts no integer past 64 bits in a request, so every integer the schema leaves unbounded (on either side) gets
the signed 64-bit bound on that side; a bound the schema gives is kept (the library itself reads bounds as doubles
and holds an integer's pattern to 64 bits: a schema cannot ask for more through it).
"""
from __future__ import annotations

from typing import Any

# The library reads bounds as doubles: at exactly -2**63 it cannot build the digits' pattern, so the lowest 1,024
# values are left out (a bound a double holds exactly; nobody's integer is within 1,024 of -2**63). An `enum` or
# `const` value there is refused: the library's pattern for it recursed until its thread's stack overflowed
# (a segfault of the whole daemon, for any integer from -2**63 to -2**63 + 511).
INT64_MIN = -(1 << 63) + 1024
INT64_MAX = (1 << 63) - 1

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas (JSON Schema 2020-12 and draft 7).
_ONE = ("additionalProperties", "additionalItems", "items", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")


def bounded_integers(schema: Any) -> Any:
    """A copy of `schema` whose unbounded integers are bounded to 64 bits; anything that is not a schema object
    (true, false, a malformed value the library will refuse) is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("enum", "const"):
        if key in out and _lowest_integer(out[key]) < INT64_MIN:
            raise ValueError(f"an integer in `{key}` is below {INT64_MIN} (-2^63 + 1024), the lowest accepted")
    kind = out.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        if not any(k in out for k in _LOWER):
            out["minimum"] = INT64_MIN
        if not any(k in out for k in _UPPER):
            out["maximum"] = INT64_MAX
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = bounded_integers(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [bounded_integers(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_integers(s) for name, s in out[key].items()}
    return out


def _lowest_integer(value: Any) -> int:
    """The lowest integer anywhere in a JSON value (0 when it holds none)."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        return min((_lowest_integer(v) for v in value), default=0)
    if isinstance(value, dict):
        return min((_lowest_integer(v) for v in value.values()), default=0)
    return 0
