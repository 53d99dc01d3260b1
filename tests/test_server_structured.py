"""Structured outputs and tool calls over real HTTP with the official openai client, on the embedded SmolLM2.

What agent frameworks call: beta.chat.completions.parse with a pydantic model, streamed and parallel tool calls
under tool_choice required, json_object mode, n > 1 under one schema, a schema the library refuses (400 naming
the construct), and a second turn carrying the assistant's calls and the tool's result through the template.
"""
from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from server_helpers import LiveDaemon, running_daemon

MODEL = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                   "required": ["zone"], "additionalProperties": False}}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.fixture(scope="module")
def live() -> LiveDaemon:
    with running_daemon(["--model", "smollm2-135m", "--served-model-name", MODEL, "--no-profile",
                         "--num-kv-blocks", "512", "--max-model-len", "2048"]) as live:
        yield live


@pytest.fixture(scope="module")
def client(live: LiveDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _valid_call(name: str, arguments: str) -> dict:
    """The call's arguments, checked against its function's schema (required keys, types, enums, no extras)."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and isinstance(args["city"], str)
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "get_time" and set(args) == {"zone"} and isinstance(args["zone"], str)
    return args


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person: a name and an age."}],
        response_format=Person, max_tokens=80, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


def test_streamed_tool_call_with_tool_choice_required(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, stream=True, max_tokens=80, temperature=0)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        assert not choice.delta.content  # a forced call has no content
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or delta.id
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    [call] = calls.values()
    assert call["id"] and call["name"] == "get_weather"
    _valid_call(call["name"], call["arguments"])


def test_parallel_tool_calls_are_each_valid(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}],
        tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=True, max_tokens=200, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) >= 1
    ids = set()
    for call in choice.message.tool_calls:
        _valid_call(call.function.name, call.function.arguments)
        ids.add(call.id)
    assert len(ids) == len(choice.message.tool_calls)


def test_a_named_function_is_called_and_auto_may_answer_in_text(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tokyo?"}], tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=80, temperature=0)
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]
    auto = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER], max_tokens=20,
        temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_object_mode_returns_json(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=300, temperature=0,
        frequency_penalty=1.0)  # greedy SmolLM2 nests "looks_at_me" objects forever without it
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_n_choices_under_one_schema_are_each_valid_streamed_and_not(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                          "minItems": 2, "maxItems": 3}},
              "required": ["colors"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "palette", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Name some colors."}]
    response = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, n=2,
                                              max_tokens=120, temperature=1.0, seed=3)
    assert len(response.choices) == 2
    for choice in response.choices:
        assert 2 <= len(json.loads(choice.message.content)["colors"]) <= 3
    texts = ["", ""]
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, n=2,
                                                max_tokens=120, temperature=1.0, seed=4, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        assert 2 <= len(json.loads(text)["colors"]) <= 3


def test_completions_take_response_format(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}}}
    response = client.completions.create(model=MODEL, prompt="A digit:", max_tokens=5,
                                         extra_body={"response_format": fmt})
    assert 1 <= json.loads(response.choices[0].text) <= 9 and response.choices[0].finish_reason == "stop"


def test_a_schema_the_library_refuses_is_a_400_naming_the_construct(client: openai.OpenAI, live: LiveDaemon) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "n", "schema": {"not": {"type": "string"}}}})
    error = caught.value.body
    assert error["param"] == "response_format" and "not" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {
                                           "type": "object", "properties": {"a": {"type": "string",
                                                                                  "format": "no-such-format"}}}}}],
                                       tool_choice="required")
    assert caught.value.body["param"] == "tools" and "no-such-format" in caught.value.body["message"]
    live.wait_idle()


def test_a_tool_result_round_trips_through_the_template(client: openai.OpenAI, live: LiveDaemon) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "{\"temperature\": 21}"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=24, temperature=0)
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason in ("stop", "length")
    # The prompt holds the call (in the family's format, SmolLM2's template has none) and the tool's result.
    prompt_tokens = second.usage.prompt_tokens
    without = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1)
    assert prompt_tokens > without.usage.prompt_tokens + 20


def test_a_grammar_request_leaves_the_daemon_idle_after_a_disconnect(live: LiveDaemon) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a dog."}], "stream": True,
            "response_format": {"type": "json_object"}, "max_tokens": 200}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and "content" in line:
                break  # leave mid-stream
    live.wait_idle()
