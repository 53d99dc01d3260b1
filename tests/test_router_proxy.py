"""The router over real HTTP: sim daemons in-process, `stallfree router` as a child process in front."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Iterator

import httpx
import pytest

from stallfree.net import free_port
from server_helpers import ADMIN_TOKEN, running_daemon

SIM_ARGS = ["--backend", "sim", "--model", "llama-3-8b", "--hardware", "h100", "--num-kv-blocks", "1024",
            "--max-token-budget", "512", "--token-budget", "256", "--max-num-seqs", "16",
            "--max-num-seqs-ceiling", "16", "--no-profile"]
MODEL = "llama-3-8b"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}  # the router shows which replica answered to an admin only


@contextlib.contextmanager
def router(urls: list[str], *extra: str) -> Iterator[str]:
    port = free_port()
    env = dict(os.environ, STALLFREE_ADMIN_TOKEN=ADMIN_TOKEN)
    process = subprocess.Popen([sys.executable, "-m", "stallfree.cli", "router", "--replicas", ",".join(urls),
                                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("the router never got ready")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def two_daemons():
    with running_daemon(base_args=SIM_ARGS) as a, running_daemon(base_args=SIM_ARGS) as b:
        yield a, b


def wait_until(predicate, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s")


def events(response: httpx.Response) -> list[dict]:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_streams_usage_and_errors_pass_through(two_daemons):
    a, b = two_daemons
    with router([a.url, b.url], "--policy", "round-robin") as url:
        body = {"model": MODEL, "prompt": "tell me a story", "max_tokens": 12, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        seen = set()
        for _ in range(2):
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30, headers=ADMIN) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                seen.add(response.headers["x-stallfree-replica"])
                got = events(response)
            text = "".join(c["text"] for e in got for c in e["choices"])
            assert len(text) == 12
            assert got[-1]["usage"]["completion_tokens"] == 12
        assert len(seen) == 2  # round-robin used both
        plain = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 3
        missing = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        bad = httpx.post(url + "/v1/completions", content=b"{not json", timeout=10,
                         headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "error" in bad.json()
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
        metrics = httpx.get(url + "/metrics", timeout=10, headers=ADMIN).text  # picks name replicas: admin only
        assert 'stallfree_router_picks_total{policy="round-robin"' in metrics
        assert "stallfree_router_replicas_healthy 2.0" in metrics


def test_a_draining_replica_is_left_within_two_seconds_and_taken_back(two_daemons):
    a, b = two_daemons
    with router([a.url, b.url], "--policy", "round-robin") as url:
        a.daemon.drain.begin()
        try:
            wait_until(lambda: httpx.get(url + "/ready", timeout=1).json().get("replicas_healthy") == 1, 2.0)
            for _ in range(4):
                response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                                      timeout=10, headers=ADMIN)
                assert response.status_code == 200
                assert response.headers["x-stallfree-replica"] == b.url.split("://")[1]
        finally:
            a.daemon.drain.draining = False
        wait_until(lambda: httpx.get(url + "/ready", timeout=1).json().get("replicas_healthy") == 2, 2.0)


def test_a_refusal_before_the_first_byte_is_retried_on_another_replica(two_daemons):
    a, b = two_daemons
    # A slow health poll: the router still believes `a` healthy when it starts refusing.
    with router([a.url, b.url], "--policy", "round-robin", "--poll-interval-s", "30") as url:
        a.daemon.drain.begin()
        try:
            for _ in range(4):
                response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                                      timeout=10, headers=ADMIN)
                assert response.status_code == 200
                assert response.headers["x-stallfree-replica"] == b.url.split("://")[1]
        finally:
            a.daemon.drain.draining = False
        metrics = httpx.get(url + "/metrics").text
        assert "stallfree_router_retries_total{reason=\"HTTP 503\"} 2.0" in metrics


def test_no_ready_replica_is_a_clear_503():
    dead = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "stallfree.cli", "router", "--replicas", dead, "--host",
                                "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(url), 20)
        assert httpx.get(url + "/ready").status_code == 503
        response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert response.status_code == 503 and response.json()["error"]["code"] == "no_ready_replica"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_no_redirect_is_built_from_the_host_header():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "stallfree.cli", "router", "--replicas",
                                f"http://127.0.0.1:{free_port()}", "--host", "127.0.0.1", "--port", str(port),
                                "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(url), 20)
        for path in ("/health/", "/ready/", "/metrics/"):
            response = httpx.get(url + path, headers={"Host": "evil.example"}, timeout=10)
            assert response.status_code == 404 and "evil.example" not in str(response.headers), response.headers
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_client_that_leaves_aborts_the_request_on_the_replica(two_daemons):
    a, b = two_daemons
    with router([a.url], "--policy", "slo-aware") as url:
        body = {"model": MODEL, "prompt": "go on", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i > 6:
                    break
        wait_until(lambda: not a.llm_engine.has_unfinished() and not a.daemon.drain.in_flight, 3.0)


def test_a_client_that_leaves_a_non_streamed_request_aborts_it_on_the_replica(two_daemons):
    a, b = two_daemons
    with router([a.url]) as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=1.0))
        wait_until(lambda: not a.llm_engine.has_unfinished() and not a.daemon.drain.in_flight, 3.0)


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
        return True
    except httpx.HTTPError:
        return False
