"""Tool-call parsers by family: whole outputs and streams (deltas accumulate, as the openai client does, to the
same calls), parallel calls, text that only looks like a call, format choice, tools and tool_choice checks."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from stallfree.node_daemon.text.tool_calls.formats import HERMES, LLAMA3_JSON, MISTRAL, choose_format, detect_format, format_named
from stallfree.node_daemon.text.tool_calls.parser import ToolCallStreamParser, accumulate_tool_calls, parse_tool_calls
from stallfree.node_daemon.text.tool_calls.schema import call_schema, forced_tool_calls
from stallfree.node_daemon.text.tool_calls.tools import parse_tool_choice, parse_tools


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _calls(*pairs):
    return [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(pairs)]


# (format, model output, content, calls)
CASES = [
    ("qwen one call", HERMES,
     '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n</tool_call>',
     None, _calls(("get_weather", '{"location": "Paris, France", "unit": "celsius"}'))),
    ("qwen text then two calls", HERMES,
     'Let me check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Tokyo"}}\n</tool_call>',
     "Let me check both cities.\n",
     _calls(("get_weather", '{"location": "Paris"}'), ("get_weather", '{"location": "Tokyo"}'))),
    ("hermes nested arguments with braces in strings", HERMES,
     '<tool_call>\n{"arguments": {"query": "a {b} [c] \\"d\\"", "filters": {"tags": ["x", "y"], "n": 3}}, "name": "search"}\n</tool_call>',
     None, _calls(("search", '{"query": "a {b} [c] \\"d\\"", "filters": {"tags": ["x", "y"], "n": 3}}'))),
    ("hermes arguments as a JSON string", HERMES,
     '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None, _calls(("f", '{"a": 1}'))),
    ("hermes no arguments", HERMES, '<tool_call>{"name": "now"}</tool_call>', None, _calls(("now", "{}"))),
    ("hermes plain answer", HERMES, "The weather in Paris is sunny, 21 °C.", "The weather in Paris is sunny, 21 °C.", []),
    ("hermes marker then prose is content", HERMES, "Use <tool_call> tags, like this: done", "Use <tool_call> tags, like this: done", []),
    ("llama3 one call", LLAMA3_JSON,
     '{"name": "get_weather", "parameters": {"location": "San Francisco, CA", "unit": "fahrenheit"}}',
     None, _calls(("get_weather", '{"location": "San Francisco, CA", "unit": "fahrenheit"}'))),
    ("llama3 python tag and two calls", LLAMA3_JSON,
     '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     None, _calls(("a", '{"x": 1}'), ("b", "{}"))),
    ("llama3 JSON answer that is no call", LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),
    ("llama3 prose with braces", LLAMA3_JSON, 'Sure: {"name": "x"} is how a call looks.',
     'Sure: {"name": "x"} is how a call looks.', []),
    ("mistral two calls", MISTRAL,
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]',
     None, _calls(("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}'))),
    ("mistral without its special marker", MISTRAL, ' [{"name": "get_time", "arguments": {"tz": "UTC"}}]',
     None, _calls(("get_time", '{"tz": "UTC"}'))),
    ("mistral prose", MISTRAL, "No tool is needed [really].", "No tool is needed [really].", []),
]


@pytest.mark.parametrize("title, fmt, text, content, calls", CASES, ids=[c[0] for c in CASES])
def test_whole_outputs_parse_to_content_and_calls(title, fmt, text, content, calls):
    assert parse_tool_calls(text, fmt, _ids()) == (content, calls)
    for call in calls:
        json.loads(call["function"]["arguments"])


def _stream(text: str, fmt, pieces: list[str]):
    parser = ToolCallStreamParser(fmt, _ids())
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return deltas


@pytest.mark.parametrize("title, fmt, text, content, calls", CASES, ids=[c[0] for c in CASES])
def test_streamed_deltas_accumulate_to_the_same_calls(title, fmt, text, content, calls):
    rng = random.Random(len(text))
    splits = [list(text)]  # one character at a time
    for _ in range(5):  # and random token-like pieces
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        deltas = _stream(text, fmt, pieces)
        streamed_content = "".join(d.content for d in deltas)
        streamed_calls = accumulate_tool_calls([tc for d in deltas for tc in d.tool_calls])
        assert streamed_calls == calls
        assert (None if calls and not streamed_content.strip() else streamed_content) == content


def test_a_call_streams_its_name_first_then_argument_fragments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>'
    deltas = [tc for d in _stream(text, HERMES, [text[i:i + 4] for i in range(0, len(text), 4)]) for tc in d.tool_calls]
    first, rest = deltas[0], deltas[1:]
    assert first["index"] == 0 and first["id"] == "call_0" and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert len(rest) > 3  # the arguments arrive in pieces, as the model writes them
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert "name" not in "".join(json.dumps(d) for d in rest)


def test_no_content_leaks_a_partial_marker():
    parser = ToolCallStreamParser(HERMES, _ids())
    assert parser.feed("Checking.<tool_").content == "Checking."
    later = parser.feed('call>{"name": "f", "arguments": {}}</tool_call>')
    assert later.content == "" and later.tool_calls[0]["function"]["name"] == "f"


def test_a_call_cut_by_max_tokens_keeps_what_was_sent():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'
    content, calls = parse_tool_calls(text, HERMES, _ids())
    assert content is None and calls == _calls(("f", '{"a": [1, 2'))


def test_parallel_calls_are_indexed_in_order():
    text = "".join(f'<tool_call>{{"name": "f{i}", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(4))
    _, calls = parse_tool_calls(text, HERMES, _ids())
    assert [c["function"]["name"] for c in calls] == ["f0", "f1", "f2", "f3"]
    assert [c["id"] for c in calls] == ["call_0", "call_1", "call_2", "call_3"]


def test_the_openai_client_accumulates_the_stream_to_the_same_message():
    pytest.importorskip("openai")
    from openai.lib.streaming.chat._completions import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    text = ('I will look.<tool_call>{"name": "get_weather", "arguments": {"location": "Paris"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
    state = ChatCompletionStreamState()
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    for n, delta in enumerate(_stream(text, HERMES, pieces)):
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": delta.content or None,
                                                    "tool_calls": delta.tool_calls or None},
                              "finish_reason": None}]}
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    state.handle_chunk(ChatCompletionChunk.model_validate(final))
    message = state.get_final_completion().choices[0].message
    assert message.content == "I will look."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("call_0", "get_weather", {"location": "Paris"}), ("call_1", "get_time", {"tz": "CET"})]


# ---- which format


def test_the_format_comes_from_the_template_markers_or_a_name():
    assert detect_format("{% for m in messages %}<tool_call>{{ m }}</tool_call>{% endfor %}") is HERMES
    assert detect_format("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]") is MISTRAL
    assert detect_format("<|start_header_id|>ipython<|end_header_id|>{% if tools %}<|python_tag|>{% endif %}") is LLAMA3_JSON
    assert detect_format("<|im_start|>{{ m.content }}<|im_end|>") is None
    assert choose_format(None, None) is HERMES
    assert choose_format("qwen", "[TOOL_CALLS]") is HERMES  # the flag wins
    assert format_named("llama3") is LLAMA3_JSON
    with pytest.raises(ValueError, match="unknown tool-call parser 'granite'"):
        format_named("granite")


# ---- tools and tool_choice

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_choice_modes():
    tools = parse_tools([WEATHER, TIME])
    assert tools[1].parameters == {"type": "object", "properties": {}}
    assert parse_tool_choice(tools).mode == "auto" and parse_tool_choice([]).mode == "none"
    required = parse_tool_choice(tools, "required", parallel_tool_calls=False)
    assert required.forces_call and not required.parallel and len(required.tools) == 2
    named = parse_tool_choice(tools, {"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "function" and [t.name for t in named.tools] == ["get_time"]


@pytest.mark.parametrize("tools, choice, says", [
    ([{"type": "function", "function": {"name": "bad name"}}], None, "1-64 letters"),
    ([{"type": "retrieval"}], None, r"tools\[0\] must be"),
    ([WEATHER, WEATHER], None, "same function twice: get_weather"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
    ([WEATHER], "sometimes", "'sometimes' is not one of"),
    ([], "required", "needs tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "parameters must be a JSON Schema"),
])
def test_bad_tools_and_choices_say_what_is_wrong(tools, choice, says):
    with pytest.raises(ValueError, match=says):
        parse_tool_choice(parse_tools(tools), choice)


def test_the_forced_call_schema_ties_each_name_to_its_arguments():
    tools = parse_tools([WEATHER, TIME])
    schema = call_schema(tools, "parameters")
    weather, time_ = schema["anyOf"]
    assert weather["properties"]["name"] == {"const": "get_weather"}
    assert weather["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert weather["required"] == ["name", "parameters"] and weather["additionalProperties"] is False
    assert time_["properties"]["name"] == {"const": "get_time"}
    assert forced_tool_calls(parse_tool_choice(tools, "auto"), HERMES) is None
    forced = forced_tool_calls(parse_tool_choice(tools, "required", False), MISTRAL)
    assert forced.calls_schema()["maxItems"] == 1
