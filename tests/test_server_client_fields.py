"""What a client sends straight to a daemon and is not the daemon's to believe or ignore: stop strings past the
bound, legacy function-calling and guided-decoding fields (a 400 naming each, never a silent 200), and a queue-time
header the router did not sign (ignored, counted)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from server_helpers import ADMIN_TOKEN, LiveDaemon, running_daemon
from stallfree.node_daemon.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from stallfree.node_daemon.server.generation import router_wait
from stallfree.router_queue_header import QUEUE_HEADER, SIGNATURE_HEADER, sign

MODEL = "tiny"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live() -> LiveDaemon:
    with running_daemon() as live:
        yield live


@pytest.fixture()
def http(live: LiveDaemon) -> httpx.Client:
    with httpx.Client(base_url=live.url, timeout=30) as client:
        yield client


def _refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


@pytest.mark.parametrize("stop", [["x"] * (MAX_STOP_STRINGS + 1), [""] * 100_000, "y" * (MAX_STOP_CHARS + 1),
                                  ["ok", "z" * (MAX_STOP_CHARS + 1)]])
def test_stop_past_the_bound_is_400_naming_it(http: httpx.Client, stop) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}), (CHAT, {"messages": MESSAGES})):
        message = _refused(http.post(path, json={"model": MODEL, "max_tokens": 2, "stop": stop, **body}), "stop")
        assert str(MAX_STOP_STRINGS) in message or str(MAX_STOP_CHARS) in message


def test_stop_at_the_bound_is_served(http: httpx.Client) -> None:
    stop = [chr(0x4E00 + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)]
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stop": stop})
    assert response.status_code == 200, response.text


def test_include_stop_str_in_output(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 12, "temperature": 0}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[3:5]
    assert len(stop) == 2
    cut = full[:full.index(stop)]
    plain = http.post("/v1/completions", json=body | {"stop": [stop]}).json()["choices"][0]
    assert plain["text"] == cut and plain["finish_reason"] == "stop"
    kept = http.post("/v1/completions", json=body | {"stop": [stop], "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == cut + stop


LEGACY = {
    "guided_json": {"type": "object"},
    "guided_regex": "[0-9]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": "root ::= \"a\"",
}


@pytest.mark.parametrize("field", sorted(LEGACY))
def test_legacy_fields_are_refused_by_name_not_ignored(http: httpx.Client, field: str) -> None:
    message = _refused(http.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                             field: LEGACY[field]}), field)
    assert field in message and "response_format" in message
    # vLLM takes these on the completions endpoint too
    _refused(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", field: LEGACY[field]}), field)


def test_deprecated_functions_and_function_call_are_served_as_tools(http: httpx.Client) -> None:
    """OpenAI's deprecated function calling: the named function is called, under its parameters' schema."""
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}]
    response = http.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "functions": functions,
                                     "function_call": {"name": "get_weather"}, "parallel_tool_calls": False})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] in ("tool_calls", "length")
    if choice["finish_reason"] == "tool_calls":
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])


def test_legacy_fields_sent_empty_are_absent(http: httpx.Client) -> None:
    response = http.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "functions": None,
                                     "function_call": None, "guided_json": None})
    assert response.status_code == 200, response.text


def _queue_wait_max_ms(live: LiveDaemon) -> float:
    stats = httpx.get(live.url + "/admin/stats", headers=live.admin_headers, timeout=5).json()
    return stats["queue_wait_ms"]["max"]


def test_a_queue_time_header_counts_only_when_the_router_signed_it(http: httpx.Client, live: LiveDaemon) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    ignored = router_wait.ignored
    forged = [{QUEUE_HEADER: "600000"},
              {QUEUE_HEADER: "600000", SIGNATURE_HEADER: sign("600000", "not-the-admin-token", time.time())},
              {QUEUE_HEADER: "600000", SIGNATURE_HEADER: sign("1", ADMIN_TOKEN, time.time())},  # another value's
              {QUEUE_HEADER: "600000", SIGNATURE_HEADER: sign("600000", ADMIN_TOKEN, time.time() - 3600)},  # stale
              {QUEUE_HEADER: "600000", SIGNATURE_HEADER: "garbage"}]
    for headers in forged:
        assert http.post("/v1/completions", json=body, headers=headers).status_code == 200
    assert router_wait.ignored == ignored + len(forged)
    assert _queue_wait_max_ms(live) < 60_000
    signed = {QUEUE_HEADER: "2500", SIGNATURE_HEADER: sign("2500", ADMIN_TOKEN, time.time())}
    assert http.post("/v1/completions", json=body, headers=signed).status_code == 200
    assert 2500 <= _queue_wait_max_ms(live) < 60_000
    assert router_wait.ignored == ignored + len(forged)
