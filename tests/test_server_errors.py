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


def test_wrong_types_are_422_and_name_the_field(http: httpx.Client) -> None:
    error = _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"}),
                          422)
    assert "max_tokens" in error["message"]
    _assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hello"}), 422)
    _assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard",
                                                                                          "content": "hi"}]}), 422)
    _assert_error(http.post("/v1/completions", json={"model": MODEL}), 422)  # prompt missing
    _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1}), 422)
    _still_serving(http)


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
