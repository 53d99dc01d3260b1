"""A forced tool call (tool_choice required or named) decoded under its grammar over SmolLM2's tokenizer is
text the family's parser reads back as calls whose arguments validate against the function named."""
from __future__ import annotations

import json

import jsonschema
import pytest

from stallfree.node_daemon.structured.compiler import GrammarCompiler
from stallfree.node_daemon.structured.tool_grammar import tool_call_grammar
from stallfree.node_daemon.text.tool_calls.formats import HERMES, LLAMA3_JSON, MISTRAL
from stallfree.node_daemon.text.tool_calls.parser import parse_tool_calls
from stallfree.node_daemon.text.tool_calls.schema import forced_tool_calls
from stallfree.node_daemon.text.tool_calls.tools import parse_tool_choice, parse_tools
from tests.structured_helpers import FakeModel, masked_greedy, smollm2_tokenizer

TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
])
PARAMETERS = {t.name: t.parameters for t in TOOLS}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(smollm2_tokenizer())


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["required", "named"])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "single"])
def test_a_forced_call_parses_and_validates(compiler, fmt, choice, parallel):
    tokenizer = compiler.tokenizer
    forced = forced_tool_calls(parse_tool_choice(TOOLS, choice, parallel), fmt)
    compiled = compiler.compile(tool_call_grammar(forced))
    for seed in range(2):
        [(tokens, finish)] = masked_greedy(compiled, FakeModel(tokenizer, seed, eos_bonus=6.0), tokenizer.eos_token_ids)
        assert finish == "stop"
        text = tokenizer.decode(tokens)
        content, calls = parse_tool_calls(text, fmt)
        assert content is None and calls, text
        if not parallel:
            assert len(calls) == 1
        # compact JSON: no layout the model could spend tokens on (hermes' own lines only)
        assert text.count("\n") == (3 * len(calls) - 1 if fmt is HERMES else 0), text
        for call in calls:
            name = call["function"]["name"]
            assert name == "add" or (choice == "required" and name == "get_weather")
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])


def test_a_marker_that_is_a_special_token_is_generated_as_that_token(compiler):
    tokenizer = compiler.tokenizer
    marker_id = tokenizer.token_to_id("<|im_start|>")  # stands in for a tokenizer's [TOOL_CALLS]
    forced = forced_tool_calls(parse_tool_choice(TOOLS, "required", False), MISTRAL)
    compiled = compiler.compile(tool_call_grammar(forced, lambda text: marker_id if text == "[TOOL_CALLS]" else None))
    call = '[{"name":"add","arguments":{"a":1,"b":2}}]'
    matcher = compiled.new_matcher()
    assert all(matcher.accept(t) for t in [marker_id, *tokenizer.encode(call, add_special_tokens=False)])
    assert matcher.is_accepting()
    spelled = compiled.new_matcher()
    assert not spelled.accept(tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False)[0])


def test_a_forced_call_wins_over_response_format_and_auto_leaves_it():
    from stallfree.node_daemon.structured.request_grammar import request_grammar

    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
    forced = request_grammar(schema_format, parse_tool_choice(TOOLS, "required"), HERMES)
    assert forced.origin == "tool_calls:hermes"
    assert request_grammar(schema_format, parse_tool_choice(TOOLS, "auto"), HERMES).origin == "json_schema:answer"
    assert request_grammar(None, parse_tool_choice(TOOLS, "auto"), HERMES) is None
    assert request_grammar({"type": "json_object"}, None, HERMES).origin == "json_object"
    with pytest.raises(ValueError, match="Unimplemented keys"):
        bad = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}])
        request_grammar(None, parse_tool_choice(bad, "required"), HERMES)


def test_special_token_lookup_finds_only_special_tokens(compiler):
    from stallfree.node_daemon.structured.request_grammar import special_token_lookup

    lookup = special_token_lookup(compiler.tokenizer)
    assert lookup("<|im_start|>") == compiler.tokenizer.token_to_id("<|im_start|>")
    assert lookup("hello") is None and lookup("[TOOL_CALLS]") is None
