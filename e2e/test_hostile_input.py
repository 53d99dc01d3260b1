"""Bad input at every door of a live daemon: the OpenAPI schema fuzzed by schemathesis, hostile JSON
bodies from hypothesis, and admin calls without or with a wrong token. Never a 5xx, never a stack trace,
always OpenAI-style error JSON, and the daemon keeps serving what it had already accepted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

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

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12)
# Near-valid bodies: the real field names with values of any type, so validation paths are exercised.
FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "n", "stop", "seed", "stream", "stream_options", "logprobs", "ignore_eos", "top_logprobs", "echo",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias")
near_valid = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)


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
    response = httpx.post(live.url + path, json=body, timeout=30)
    assert_clean_error(response)


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
