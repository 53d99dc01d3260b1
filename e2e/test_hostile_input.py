"""Bad input at every door of a live daemon: the OpenAPI schema fuzzed by schemathesis, hostile JSON
bodies from hypothesis (wrong types, lone surrogates in any string, NaN/Infinity and numbers past 64 bits,
deep nesting, on every route including the admin ones), absurd query parameters, unknown models, seeds
past 64 bits, half-sent requests, and admin calls without or with a wrong token. Never a 5xx, never a
stack trace, always OpenAI-style error JSON, and the daemon keeps serving what it had already accepted."""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_helpers import ADMIN_TOKEN, running_daemon  # noqa: E402

from stallfree.bench.soak import SIM_DAEMON_ARGS  # noqa: E402

pytestmark = pytest.mark.slow

INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")
ADMIN_PATHS = ("/admin/tuning", "/admin/stats", "/admin/profile")

# Strings may hold lone UTF-16 surrogates (json.dumps writes them as \\ud800 escapes).
hostile_text = st.text(alphabet=st.characters(codec=None, categories=None) | st.characters(min_codepoint=0xD800,
                                                                                               max_codepoint=0xDFFF),
                       max_size=40)
# Numbers past 64 bits and non-finite floats (sent as NaN / Infinity, which Python's json parses).
hostile_numbers = st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [2**64, -(2**63) - 1, 10**30, 1e308, float("inf"), float("nan")])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | hostile_numbers | st.text(max_size=40) | hostile_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12) | hostile_text, children,
                                                                      max_size=4),
    max_leaves=12)
# Near-valid bodies: the real field names with values of any type, so validation paths are exercised.
FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "ignore_eos", "stop_token_ids",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "echo", "best_of",
          "suffix", "user", "tools", "tool_choice", "response_format")
near_valid = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)
TUNING_FIELDS = ("token_budget", "max_num_seqs", "max_partial_prefills", "long_prefill_threshold")


def send_json(method: str, url: str, body, headers: dict | None = None) -> httpx.Response:
    """Our own serialization (ASCII escapes, NaN allowed): httpx's json= refuses both."""
    return httpx.request(method, url, content=json.dumps(body).encode(), timeout=30,
                         headers={"content-type": "application/json", **(headers or {})})


@pytest.fixture(scope="module")
def live():
    with running_daemon(SIM_DAEMON_ARGS, base_args=[]) as daemon:
        yield daemon


def assert_clean_error(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    assert "Traceback" not in response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and "type" in error


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(INFERENCE_PATHS), body=near_valid | json_values)
def test_hostile_json_bodies_get_clean_errors(live, path, body):
    if isinstance(body, dict) and body.get("stream") is True:
        body["stream"] = False  # one answer per example keeps the fuzz bounded; streams are tested elsewhere
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 8)
    if isinstance(body, dict) and isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], 4)  # n up to 128 is valid; a few choices keep each example short
    assert_clean_error(send_json("POST", live.url + path, body))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(st.sampled_from(TUNING_FIELDS), json_values, max_size=3) | json_values)
def test_hostile_admin_tuning_bodies_get_clean_errors_and_change_nothing_when_refused(live, body):
    before = httpx.get(live.url + "/admin/tuning", headers=live.admin_headers).json()
    response = send_json("PUT", live.url + "/admin/tuning", body, live.admin_headers)
    assert_clean_error(response)
    if response.status_code >= 400:
        assert httpx.get(live.url + "/admin/tuning", headers=live.admin_headers).json() == before
    else:
        httpx.put(live.url + "/admin/tuning", json=before, headers=live.admin_headers)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=st.text(max_size=30) | hostile_numbers.map(repr))
def test_hostile_admin_query_parameters_get_clean_errors(live, value):
    response = httpx.get(live.url + "/admin/profile", params={"tpot_slo_ms": value}, headers=live.admin_headers,
                         timeout=30)
    assert_clean_error(response)


@pytest.mark.parametrize("method, path", [("POST", p) for p in INFERENCE_PATHS] + [("PUT", "/admin/tuning")])
@pytest.mark.parametrize("depth", [33, 1000, 50_000])
def test_deep_nesting_is_a_400_on_every_route(live, method, path, depth):
    raw = ("[" * depth + "]" * depth).encode()
    response = httpx.request(method, live.url + path, content=raw, timeout=30,
                             headers={"content-type": "application/json", **live.admin_headers})
    assert_clean_error(response)
    assert response.status_code == 400


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**40])
def test_seeds_past_64_bits_are_400(live, seed):
    body = {"model": "llama-3-8b", "prompt": "x", "max_tokens": 2, "temperature": 1.0, "seed": seed}
    response = send_json("POST", live.url + "/v1/completions", body)
    assert_clean_error(response)
    assert response.status_code == 400


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(model=st.text(min_size=1, max_size=40).filter(lambda m: m != "llama-3-8b" and "/" not in m and "?" not in m
                                                      and "#" not in m and m not in (".", "..")))
def test_unknown_models_are_404_everywhere(live, model):
    for response in (send_json("POST", live.url + "/v1/completions", {"model": model, "prompt": "x"}),
                     httpx.get(live.url + "/v1/models/" + quote(model, safe=""), timeout=30)):
        assert_clean_error(response)
        assert response.status_code == 404


def test_half_sent_requests_do_not_stop_the_daemon(live):
    """A few slowloris connections (headers or body cut short): the daemon keeps answering everyone else."""
    host, port = live.url.removeprefix("http://").split(":")
    socks = []
    for i in range(40):
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else
                     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{")
        socks.append(sock)
    try:
        t0 = time.monotonic()
        response = httpx.post(live.url + "/v1/completions", json={"model": "llama-3-8b", "prompt": "hi",
                                                                  "max_tokens": 2}, timeout=30)
        assert response.status_code == 200 and time.monotonic() - t0 < 10
    finally:
        for sock in socks:
            sock.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=200))
def test_bytes_that_are_not_json_get_400(live, raw):
    response = httpx.post(live.url + "/v1/completions", content=raw, timeout=30,
                          headers={"content-type": "application/json"})
    assert_clean_error(response)
    try:
        json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        assert response.status_code == 400


def test_openapi_schema_fuzzed_by_schemathesis(live):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    checked = 0
    for operation in schema.get_all_operations():
        op = operation.ok()
        if not op.path.startswith("/v1/"):
            continue

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def fuzz(case):
            if isinstance(case.body, dict):
                case.body["stream"] = False
                case.body["max_tokens"] = 4
            response = case.call(base_url=live.url, timeout=30)
            assert response.status_code < 500, (case.body, response.text[:300])
            assert "Traceback" not in response.text

        fuzz()
        checked += 1
    assert checked >= 3  # completions, chat completions, models


@pytest.mark.parametrize("path", ADMIN_PATHS)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token"}, {"Authorization": "Basic x"}],
                         ids=["no-token", "wrong-token", "wrong-scheme"])
def test_admin_refuses_without_the_right_token(live, path, headers):
    before = httpx.get(live.url + "/admin/tuning", headers=live.admin_headers).json()
    method = httpx.put if path == "/admin/tuning" else httpx.get
    kwargs = {"json": {"token_budget": 64}} if method is httpx.put else {}
    response = method(live.url + path, headers=headers, timeout=10, **kwargs)
    assert response.status_code in (401, 403)
    assert_clean_error(response)
    assert httpx.get(live.url + "/admin/tuning", headers=live.admin_headers).json() == before


def test_the_daemon_still_serves_after_the_fuzz(live):
    response = httpx.post(live.url + "/v1/completions", timeout=30,
                          json={"model": "llama-3-8b", "prompt": "still there?", "max_tokens": 5})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
    live.wait_idle()
    assert live.llm_engine.kv_cache.num_free_blocks == live.llm_engine.kv_cache.num_blocks
