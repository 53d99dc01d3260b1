"""Bad input gets OpenAI-style error JSON with the right status, never a stack trace; the server keeps serving."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server_helpers import LiveDaemon, running_daemon

MODEL = "tiny"
MAX_MODEL_LEN = 256
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def live() -> LiveDaemon:
    with running_daemon(["--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", str(BODY_LIMIT)]) as live:
        yield live


@pytest.fixture()
def http(live: LiveDaemon) -> httpx.Client:
    with httpx.Client(base_url=live.url, timeout=30) as client:
        yield client


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text and 'File "' not in response.text
    if param is not None:
        assert error["param"] == param
    return error


def _still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_malformed_json_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"})
    _assert_error(r, 400)
    r = http.post("/v1/chat/completions", content=b"[1, 2, 3]", headers={"content-type": "application/json"})
    _assert_error(r, 400)
    _still_serving(http)


def test_wrong_types_and_invalid_values_are_400_and_name_the_field(http: httpx.Client) -> None:
    """OpenAI answers 400 invalid_request_error (the openai client's BadRequestError), never 422."""
    error = _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"}),
                          400, "max_tokens")
    assert "max_tokens" in error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_type"
    _assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hello"}), 400)
    _assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard",
                                                                                          "content": "hi"}]}), 400)
    _assert_error(http.post("/v1/completions", json={"model": MODEL}), 400)  # prompt missing
    error = _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1}),
                          400, "temperature")
    assert error["code"] == "invalid_value"
    _still_serving(http)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", True), ("max_tokens", 2.0), ("stream", "yes"), ("stream", 1), ("n", True), ("seed", "7"),
    ("temperature", "0.5"), ("temperature", True), ("ignore_eos", "false"), ("stop_token_ids", [True]),
    ("model", ["tiny"]), ("prompt", 12), ("top_k", 1.5),
])
def test_no_silent_type_coercion(http: httpx.Client, field: str, value) -> None:
    """`"max_tokens": true` is not 1 and `"stream": "yes"` is not true: a wrong type is a 400, not a guess."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, field: value}
    error = _assert_error(http.post("/v1/completions", json=body), 400)
    assert error["param"].split(".")[0] == field and error["code"] == "invalid_type"


def test_an_int_is_still_a_valid_float(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0,
                                           "top_p": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("seed", [1 << 64, -(1 << 63) - 1, 10 ** 30])
def test_a_seed_beyond_64_bits_is_400_and_the_server_keeps_serving(http: httpx.Client, seed: int) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 1.0, "seed": seed}
    error = _assert_error(http.post("/v1/completions", json=body), 400)
    assert "64" in error["message"]
    for good in (0, (1 << 64) - 1, -(1 << 63)):
        ok = http.post("/v1/completions", json=body | {"seed": good})
        assert ok.status_code == 200, ok.text
    _still_serving(http)


def test_bad_tools_tool_choice_and_response_format_are_400_naming_the_field(http: httpx.Client) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        _assert_error(http.post("/v1/chat/completions", json=chat | {"tool_choice": choice}), 400, "tool_choice")
    tools = [{"type": "function", "function": {"name": "f"}}]
    _assert_error(http.post("/v1/chat/completions", json=chat | {"tools": tools, "tool_choice": {
        "type": "function", "function": {"name": "g"}}}), 400, "tool_choice")
    _assert_error(http.post("/v1/chat/completions", json=chat | {"tools": [{"type": "function", "function": {
        "name": "bad name"}}]}), 400, "tools")
    _assert_error(http.post("/v1/chat/completions", json=chat | {"response_format": {"type": "yaml"}}), 400,
                  "response_format")
    _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}), 400, "response_format")


SURROGATE_BODIES = [
    ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "stop": ["a\\udc00"], "max_tokens": 2}'),
    ("/v1/completions", '{"model": "tiny\\ud83d", "prompt": "x"}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "user": "\\udfff"}'),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}'),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "\\ud800"}]}]}'),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "\\ud800": 1}'),
]


@pytest.mark.parametrize("path, raw", SURROGATE_BODIES)
def test_lone_surrogates_in_any_text_field_are_400(http: httpx.Client, path: str, raw: str) -> None:
    error = _assert_error(http.post(path, content=raw.encode(), headers={"content-type": "application/json"}), 400)
    assert error["code"] == "invalid_unicode"
    _still_serving(http)


@pytest.mark.parametrize("method, path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                          ("PUT", "/admin/tuning"), ("POST", "/admin/tuning")])
@pytest.mark.parametrize("depth", [40, 20_000])  # 20k: past the parser's recursion limit
def test_deep_json_nesting_is_400_on_every_route(http: httpx.Client, live: LiveDaemon, method: str, path: str,
                                                 depth: int) -> None:
    raw = '{"model": "tiny", "prompt": ' + "[" * depth + "]" * depth + "}"
    response = http.request(method, path, content=raw.encode(), headers={"content-type": "application/json",
                                                                         **live.admin_headers})
    error = _assert_error(response, 400)
    assert "nested" in error["message"]
    _still_serving(http)


@pytest.mark.parametrize("method, path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                          ("PUT", "/admin/tuning")])
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999", "1" * 30, "18446744073709551616"])
def test_non_finite_and_absurd_numbers_are_400_on_every_route(http: httpx.Client, live: LiveDaemon, method: str,
                                                              path: str, number: str) -> None:
    raw = '{"model": "tiny", "prompt": "x", "messages": [], "temperature": %s, "token_budget": %s}' % (number, number)
    response = http.request(method, path, content=raw.encode(), headers={"content-type": "application/json",
                                                                         **live.admin_headers})
    assert _assert_error(response, 400)["code"] == "invalid_number"


@pytest.mark.parametrize("query", ["inf", "-inf", "nan", "1e400", "0", "-5", "1e300", "abc"])
def test_absurd_admin_query_parameters_are_400(http: httpx.Client, live: LiveDaemon, query: str) -> None:
    response = http.get(f"/admin/profile?tpot_slo_ms={query}", headers=live.admin_headers)
    _assert_error(response, 400, "tpot_slo_ms" if query != "abc" else None)
    # A sane value is not refused (the profile itself may still be measuring on the idle engine: 404 no_profile).
    sane = http.get("/admin/profile?tpot_slo_ms=50", headers=live.admin_headers)
    assert sane.status_code == 200 or (sane.status_code == 404 and sane.json()["error"]["code"] == "no_profile")


def test_a_refused_request_logs_one_line_at_most(http: httpx.Client, caplog) -> None:
    import logging

    with caplog.at_level(logging.DEBUG):
        for path, raw in SURROGATE_BODIES[:3]:
            http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
        http.post("/v1/completions", content=b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                  headers={"content-type": "application/json"})
        http.get("/admin/profile?tpot_slo_ms=inf")
    server = [r for r in caplog.records if r.name.startswith(("stallfree", "uvicorn", "fastapi"))]
    assert len(server) <= 5, [r.getMessage() for r in server]
    assert not any(r.exc_info for r in server)
    assert "Traceback" not in "".join(r.getMessage() for r in server)


def test_unknown_model_is_404(http: httpx.Client) -> None:
    error = _assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert error["code"] == "model_not_found"
    _assert_error(http.get("/v1/nothing-here"), 404)
    _still_serving(http)


def test_prompt_over_the_context_is_400(http: httpx.Client) -> None:
    error = _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": list(range(1, MAX_MODEL_LEN + 1)),
                                                             "max_tokens": 1}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    _still_serving(http)


def test_max_tokens_over_the_limit_is_400(http: httpx.Client) -> None:
    error = _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3, 4],
                                                             "max_tokens": MAX_MODEL_LEN}), 400, "max_tokens")
    assert str(MAX_MODEL_LEN - 4) in error["message"]
    _assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                          "max_completion_tokens": 10 * MAX_MODEL_LEN}),
                  400, "max_completion_tokens")
    _still_serving(http)


def test_body_over_the_size_limit_is_413(http: httpx.Client) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10)}).encode()
    _assert_error(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit must still hold while the body streams in
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    _assert_error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    _still_serving(http)


def test_unsupported_parameters_are_refused_clearly(http: httpx.Client) -> None:
    error = _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "best_of": 2}), 400,
                          "best_of")
    assert "best_of" in error["message"]
    _assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "n": 0,
                                                          "messages": [{"role": "user", "content": "x"}]}), 400, "n")
    _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}), 400, "prompt")
    _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 9}), 400, "logprobs")
    _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [10_000_000]}), 400, "prompt")
    _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ""}), 400, "prompt")
    _still_serving(http)


def test_admin_needs_the_bearer_token(http: httpx.Client, live: LiveDaemon) -> None:
    _assert_error(http.get("/admin/tuning"), 401)
    _assert_error(http.get("/admin/stats", headers={"Authorization": "Bearer wrong"}), 401)
    assert http.get("/admin/tuning", headers=live.admin_headers).status_code == 200


def test_bad_tuning_is_refused_and_changes_nothing(http: httpx.Client, live: LiveDaemon) -> None:
    before = http.get("/admin/tuning", headers=live.admin_headers).json()
    for body, needle in (({"token_budget": 100_000}, "ceiling"), ({"max_num_seqs": 0}, "max_num_seqs"),
                         ({"token_budget": 8, "max_num_seqs": 64}, "prefill room"), ({"chunk": 3}, "unknown"),
                         ({"token_budget": "big"}, "integer")):
        error = _assert_error(http.put("/admin/tuning", json=body, headers=live.admin_headers), 400)
        assert needle in error["message"], (body, error)
    _assert_error(http.put("/admin/tuning", content=b"{oops", headers=live.admin_headers), 400)
    assert http.get("/admin/tuning", headers=live.admin_headers).json() == before


def test_backpressure_answers_429_with_retry_after(live: LiveDaemon) -> None:
    """One running slot, a queue of two: the third waiting request is refused at once, nothing is lost."""
    admin = live.admin_headers
    before = httpx.get(live.url + "/admin/tuning", headers=admin).json()
    assert httpx.put(live.url + "/admin/tuning", json={"max_num_seqs": 1, "token_budget": 64},
                     headers=admin).status_code == 200
    admission = live.daemon.admission
    old_bound = admission.max_queue_requests
    admission.max_queue_requests = 2

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            body = {"model": MODEL, "prompt": "hog", "max_tokens": 60, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as hog:
                lines = hog.aiter_lines()
                async for line in lines:  # the hog holds the only running slot once it streams
                    if line.startswith("data: {"):
                        break
                queued = [asyncio.ensure_future(client.post("/v1/completions", json={
                    "model": MODEL, "prompt": f"queued {i}", "max_tokens": 3, "ignore_eos": True})) for i in range(2)]
                while admission.queued_requests < 2:
                    await asyncio.sleep(0.005)
                refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "one too many"})
                _assert_error(refused, 429)
                assert int(refused.headers["retry-after"]) >= 1
                assert refused.json()["error"]["code"] == "queue_full"
                rest = [line async for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            for response in await asyncio.gather(*queued):
                assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3

    try:
        asyncio.run(scenario())
    finally:
        admission.max_queue_requests = old_bound
        httpx.put(live.url + "/admin/tuning", json=before, headers=admin)
    live.wait_idle()
    assert admission.queued_requests == 0
