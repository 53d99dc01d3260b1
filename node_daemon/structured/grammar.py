"""What a request asks its output to match, as an llguidance grammar: response_format and forced tool calls.

compile_response_format() turns OpenAI's `response_format` into a Grammar, or None for plain text. It checks the
schema with the library before any tokenizer is involved, so a schema the library cannot follow is a ValueError
naming the construct (the API answers 400) before the request is queued. The Grammar is plain data (its text
is the cache key); compiler.GrammarCompiler binds it to a tokenizer.

Checking costs more than linear time in the grammar's size, so a grammar past MAX_GRAMMAR_CHARS is refused before
it is checked, and the server runs all of this on grammar_work's threads, never on its event loop. Integers the
schema leaves unbounded are bounded to 64 bits (integer_bounds.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

import llguidance

from stallfree.node_daemon.structured.integer_bounds import bounded_integers

# Compact JSON: the model spends no tokens on layout, and every row's output parses with json.loads.
_JSON_OPTIONS = {"whitespace_flexible": False}
# What `json_object` means in OpenAI's API: any JSON object.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# The largest grammar (a schema as JSON, a tool call's Lark text) that is checked at all: about 7,000 properties,
# past OpenAI's own 5,000, checked in about 2 s on one core (checking 16,000 took 14 s).
MAX_GRAMMAR_CHARS = 256 * 1024


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar (its serialized form) and where it came from, for errors and logs."""

    text: str
    origin: str  # "json_object", "json_schema:<name>", "tool_calls:<family>"


def _within_size(num_chars: int, origin: str) -> None:
    if num_chars > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{origin}: the schema is {num_chars} characters as JSON; at most {MAX_GRAMMAR_CHARS} "
                         "are accepted")


def _checked(text: str, origin: str) -> Grammar:
    """The grammar, or ValueError with the library's own words (they name the construct: 'Unimplemented keys:
    ["not"]', 'Unknown format: foo', 'Unsatisfiable schema: minimum (5) is greater than maximum (2)')."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise ValueError(f"{origin}: {messages[0] if messages else 'the grammar is invalid'}")
    return Grammar(text, origin)


def json_schema_grammar(schema: Mapping[str, Any], origin: str = "json_schema") -> Grammar:
    """A grammar for JSON documents valid against `schema` (a JSON Schema object)."""
    if not isinstance(schema, Mapping):
        raise ValueError(f"{origin}: the schema must be a JSON object, got {type(schema).__name__}")
    source = json.dumps(schema)
    _within_size(len(source), origin)
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(bounded_integers(schema)),
                                                             defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{origin}: {e}") from None
    return _checked(text, origin)


def compact(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema with the compact-JSON option attached, for `%json` inside a Lark grammar (which takes no defaults),
    its integers bounded."""
    schema = bounded_integers(dict(schema))
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **_JSON_OPTIONS}}


def lark_grammar(lark: str, origin: str) -> Grammar:
    """A grammar written in llguidance's Lark dialect (JSON Schema inside it as `%json { ... }`)."""
    _within_size(len(lark), origin)
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), origin)


def compile_response_format(response_format: Mapping[str, Any] | None) -> Grammar | None:
    """OpenAI's response_format -> the Grammar its output must match, or None for free text.

    {"type": "text"} -> None; {"type": "json_object"} -> any JSON object; {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}} -> documents valid against the schema. With or without `strict`, the output
    follows the schema exactly (the library enforces every keyword it accepts and refuses the others), so
    `strict` changes nothing here; it is accepted and checked as OpenAI defines it.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError("response_format must be an object such as {\"type\": \"json_object\"}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(ANY_JSON_OBJECT, "json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ValueError("response_format json_schema needs a `json_schema` object with a `schema`")
        name = spec.get("name", "")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError("response_format json_schema.strict must be true or false")
        schema = spec.get("schema")
        if schema is None:
            raise ValueError("response_format json_schema needs a `schema` (a JSON Schema object)")
        return json_schema_grammar(schema, f"json_schema:{name}" if name else "json_schema")
    raise ValueError(f"response_format type {kind!r} is not supported (text, json_object, json_schema are)")
