"""Near-valid tools, tool_choice and response_format values, fuzzed: every answer is a 200 or a 400 naming the field,
never a 500 or a hang, and the daemon goes on serving (the tiny random model: the grammar keeps its output valid)."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from server_helpers import LiveDaemon, running_daemon

from stallfree.node_daemon.structured.integer_bounds import INT64_MIN

MODEL = "tiny"
FIELDS = ("tools", "tool_choice", "response_format", "parallel_tool_calls", "functions", "function_call")

leaf = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-1e3, 1e3) | st.text(max_size=8)
schema_keys = st.sampled_from(["type", "properties", "items", "enum", "const", "minimum", "maximum", "minItems",
                               "maxItems", "minLength", "maxLength", "pattern", "format", "required", "anyOf",
                               "oneOf", "allOf", "not", "$ref", "additionalProperties", "prefixItems", "x"])
types = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "tuple"])
# Schemas the library takes (small, so the tiny model's output completes within max_tokens or is cut by it)...
valid_schemas = st.recursive(
    st.just({"type": "boolean"}) | st.just({"type": "null"})
    | st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6))
    | st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span}, st.integers(-9, 9),
                st.integers(0, 20))
    # Enum integers within what the daemon accepts: the JSON doors refuse wider ones (400 invalid_number) before any
    # schema is read, and a schema refuses enum and const integers below INT64_MIN (a 400: tests/test_grammar_bounds.py)
    | st.builds(lambda values: {"enum": values},
                st.lists(st.text(max_size=4) | st.integers(INT64_MIN, 2**63 - 1), min_size=1, max_size=3)),
    lambda children: st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                                              "additionalProperties": False},
                               st.dictionaries(st.from_regex(r"[a-z]{1,4}", fullmatch=True), children, max_size=3))
    | st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 3)),
    max_leaves=5)
# ... and anything shaped like a schema.
wild_schemas = st.recursive(
    st.fixed_dictionaries({"type": types}) | st.just({}) | st.just(True),
    lambda children: st.dictionaries(schema_keys, children | leaf | types | st.lists(children, max_size=3)
                                     | st.dictionaries(st.text(min_size=1, max_size=5), children, max_size=3),
                                     max_size=4),
    max_leaves=8)
schemas = valid_schemas | wild_schemas
names = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True) | st.text(max_size=6)
tools = st.lists(st.fixed_dictionaries({"type": st.just("function") | leaf,
                                        "function": st.fixed_dictionaries({"name": names},
                                                                          optional={"parameters": schemas,
                                                                                    "description": leaf})}),
                 max_size=3)
tool_choices = (st.sampled_from(["none", "auto", "required", "any"]) | leaf
                | st.fixed_dictionaries({"type": st.just("function"),
                                         "function": st.fixed_dictionaries({"name": names})}))
response_formats = (st.fixed_dictionaries({"type": st.just("json_schema"),
                                           "json_schema": st.fixed_dictionaries({"name": st.just("f"),
                                                                                 "schema": valid_schemas})})
                    | st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
                                          optional={"json_schema": st.fixed_dictionaries(
                                              {"schema": schemas}, optional={"name": names, "strict": leaf})})
                    | leaf)


@pytest.fixture(scope="module")
def live() -> LiveDaemon:
    with running_daemon() as live:
        yield live


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(tools=tools | st.none(), choice=tool_choices | st.none(), fmt=response_formats | st.none(),
       parallel=st.none() | st.booleans(), stream=st.booleans())
def test_structured_fields_get_a_200_or_a_400_naming_one(live: LiveDaemon, tools, choice, fmt, parallel,
                                                         stream) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "stream": stream}
    for name, value in (("tools", tools), ("tool_choice", choice), ("response_format", fmt),
                        ("parallel_tool_calls", parallel)):
        if value is not None:
            body[name] = value
    response = httpx.post(live.url + "/v1/chat/completions", content=json.dumps(body), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["param"] in FIELDS + ("messages",), response.text
    elif stream:
        assert "data: [DONE]" in response.text and '"error"' not in response.text, response.text


valid_tools = st.lists(st.builds(lambda name, params: {"type": "function", "function": {"name": name,
                                                                                         "parameters": params}},
                                 st.from_regex(r"[a-z]{1,6}", fullmatch=True),
                                 st.builds(lambda props: {"type": "object", "properties": props,
                                                          "required": sorted(props), "additionalProperties": False},
                                           st.dictionaries(st.from_regex(r"[a-z]{1,4}", fullmatch=True),
                                                           valid_schemas, max_size=2))),
                       min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(tools=valid_tools, choice=st.sampled_from(["required", "named", "auto"]), schema=valid_schemas,
       use_format=st.booleans(), parallel=st.booleans(), seed=st.integers(0, 1000))
def test_valid_requests_decode_to_valid_output(live: LiveDaemon, tools, choice, schema, use_format, parallel,
                                               seed) -> None:
    """Under any small schema or tool list the random model's output parses (when it was not cut by max_tokens)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "seed": seed,
            "tools": tools, "parallel_tool_calls": parallel,
            "tool_choice": ({"type": "function", "function": {"name": tools[0]["function"]["name"]}}
                            if choice == "named" else choice)}
    if use_format:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}
    response = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)
    if response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded":
        # Three tools' schemas rendered into the prompt can leave less than 400 tokens of a 2048 context: that
        # refusal is right (it names max_tokens), and the draw is no test of decoding.
        assert response.json()["error"]["param"] == "max_tokens", response.text
        assume(False)
    assert response.status_code == 200, response.text
    result = response.json()["choices"][0]
    if choice == "auto":
        if use_format and result["finish_reason"] == "stop":
            json.loads(result["message"]["content"])
        return
    assert result["finish_reason"] in ("tool_calls", "length"), result
    if result["finish_reason"] == "tool_calls":
        calls = result["message"]["tool_calls"]
        assert calls and (parallel or len(calls) == 1)
        known = {t["function"]["name"] for t in tools}
        for call in calls:
            assert call["function"]["name"] in known and isinstance(json.loads(call["function"]["arguments"]), dict)


def test_the_daemon_still_serves_after_the_fuzz(live: LiveDaemon) -> None:
    live.wait_idle()
    response = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert response.status_code == 200
