"""The doors of issue 25, tried as a hostile (or merely busy) client would: probes still answer when the
connection cap is reached, no response builds a URL from the client's Host header, an over-limit body is a
413 that asynchronous clients can read, and large structured bodies are never parsed on the event loop."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_helpers import LiveDaemon, running_daemon

from stallfree.bench.soak import SIM_DAEMON_ARGS
from stallfree.http_doors import connections

MODEL = "llama-3-8b"  # the sim backend's model (SIM_DAEMON_ARGS)
CAP = 8  # --max-connections
BODY_LIMIT = 4 << 20  # --max-body-bytes (the default)
OVER_LIMIT = 16 << 20  # well past what socket buffers absorb, so a server that never reads it resets the upload
BIG = 256 << 10  # bodies larger than this are parsed off the event loop


@pytest.fixture(scope="module")
def live() -> LiveDaemon:
    with running_daemon([*SIM_DAEMON_ARGS, "--max-connections", str(CAP), "--header-timeout-s", "30",
                         "--max-body-bytes", str(BODY_LIMIT)], base_args=[], probes=True) as live:
        yield live


def _open_connections(live: LiveDaemon) -> int:
    return len(live.server.server_state.connections)


def _wait_until(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.01)


@contextlib.contextmanager
def _idle_sockets(live: LiveDaemon, n: int):
    """n connections that send nothing, each registered by the server before the block runs."""
    host, port = live.url.removeprefix("http://").split(":")
    # Earlier requests' connections may still be closing on the server's side: the count starts from none.
    _wait_until(lambda: _open_connections(live) == 0, what="earlier connections closed")
    socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(n)]
    try:
        _wait_until(lambda: _open_connections(live) >= n, what=f"{n} connections registered")
        yield socks
    finally:
        for sock in socks:
            sock.close()
        _wait_until(lambda: _open_connections(live) == 0, what="idle connections closed")


# --- 1. liveness and readiness under the connection cap ---------------------------------------------


def test_probes_answer_when_the_connection_cap_is_reached(live: LiveDaemon) -> None:
    with _idle_sockets(live, CAP):
        health = httpx.get(live.url + "/health", timeout=10)
        ready = httpx.get(live.url + "/ready", timeout=10)
        other = httpx.get(live.url + "/v1/models", timeout=10)
    # Liveness: the daemon is busy, not broken (a kubelet restarting it would lose every request in flight).
    assert health.status_code == 200 and health.json() == {"status": "ok"}, health.text
    # Readiness says "full", so the Service sends new work elsewhere.
    assert ready.status_code == 503, ready.text
    assert ready.json()["ready"] is False and "connections" in ready.json()["reason"]
    assert other.status_code == 503 and other.headers["retry-after"] == "1"
    assert other.json()["error"]["code"] == "too_many_connections"
    assert httpx.get(live.url + "/ready", timeout=10).json() == {"ready": True}


def test_connections_past_the_probe_reserve_are_refused_at_once(live: LiveDaemon, monkeypatch) -> None:
    # Over-cap connections that send nothing keep their probe slot while this test runs.
    monkeypatch.setattr(connections, "PROBE_HEADER_TIMEOUT_S", 30.0, raising=False)
    reserve = getattr(connections, "PROBE_SLOTS", 0)
    host, port = live.url.removeprefix("http://").split(":")
    with _idle_sockets(live, CAP + reserve), socket.create_connection((host, int(port)), timeout=10) as extra:
        answer = extra.recv(65536)  # sent the moment it connects, before it asks anything
    assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer, answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


def test_the_probe_port_answers_liveness_past_the_cap_and_its_reserve(live: LiveDaemon, monkeypatch) -> None:
    # Issue 31: with every serving connection and probe slot taken, the serving port refuses /health; the
    # kubelet asks the probe port, which no client connection reaches.
    monkeypatch.setattr(connections, "PROBE_HEADER_TIMEOUT_S", 30.0, raising=False)
    host, port = live.url.removeprefix("http://").split(":")
    with _idle_sockets(live, CAP + connections.PROBE_SLOTS):
        with socket.create_connection((host, int(port)), timeout=10) as extra:
            refused = extra.recv(65536)
        health = httpx.get(live.probe_url + "/health", timeout=10)
        ready = httpx.get(live.probe_url + "/ready", timeout=10)
    assert refused.startswith(b"HTTP/1.1 503"), refused[:200]  # the serving port's /health is out of reach
    assert health.status_code == 200 and health.json() == {"status": "ok"}, health.text
    assert ready.status_code == 200 and ready.json() == {"ready": True}, ready.text
    assert httpx.get(live.probe_url + "/v1/models", timeout=10).status_code == 404  # probes only


# --- 2. no URL built from the Host header -----------------------------------------------------------


@pytest.mark.parametrize("method, path", [("GET", "/admin/stats/"), ("GET", "/health/"),
                                          ("POST", "/v1/chat/completions/"), ("GET", "/v1/models/")])
def test_no_redirect_is_built_from_the_host_header(live: LiveDaemon, method: str, path: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.request(method, live.url + path, headers={"Host": "evil.example", **live.admin_headers},
                             json=body if method == "POST" else None, timeout=10)
    assert not 300 <= response.status_code < 400, (response.status_code, response.headers)
    assert response.status_code == 404
    assert "evil.example" not in str(response.headers) + response.text


# --- 3. a 413 every client can read ------------------------------------------------------------------


def test_an_over_limit_body_is_a_413_that_async_clients_read(live: LiveDaemon) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * OVER_LIMIT}).encode()

    async def chunks():  # no Content-Length: the limit holds while the body streams in
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]

    async def scenario():
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            sized = await client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
            streamed = await client.post("/v1/completions", content=chunks(),
                                         headers={"content-type": "application/json"})
        return sized, streamed

    for response in asyncio.run(scenario()):
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "request_too_large"


def test_the_openai_client_reads_the_413_instead_of_retrying(live: LiveDaemon) -> None:
    async def create():
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        async with client:
            await client.completions.create(model=MODEL, prompt="x" * OVER_LIMIT, max_tokens=2)

    with pytest.raises(openai.APIStatusError) as caught:  # an answer, not openai.APIConnectionError
        asyncio.run(create())
    assert caught.value.status_code == 413


# --- 4. large structured bodies and the event loop ---------------------------------------------------


@contextlib.contextmanager
def _recorded_parses(hold: threading.Event | None = None):
    """Every json.loads of a body larger than BIG in this process: the parsing thread's name. With `hold`,
    a parse off the calling threads waits for it (deadline 30 s) before it runs."""
    real = json.loads
    parses: list[str] = []
    started = threading.Event()

    def loads(s, *args, **kwargs):
        if len(s) > BIG:
            parses.append(threading.current_thread().name)
            started.set()
            if hold is not None and threading.current_thread().name != "test-uvicorn":
                hold.wait(30)
        return real(s, *args, **kwargs)

    json.loads = loads
    try:
        yield parses, started
    finally:
        json.loads = real


def _post(live: LiveDaemon, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(live.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)


def test_structured_bodies_past_the_bounds_are_refused_before_parsing(live: LiveDaemon) -> None:
    ids = json.dumps({"model": MODEL, "prompt": [7] * 1_330_000, "max_tokens": 2}).encode()
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 100_000}).encode()
    assert len(ids) < BODY_LIMIT and len(chat) < BODY_LIMIT
    with _recorded_parses() as (parses, _):
        answers = [_post(live, "/v1/completions", ids), _post(live, "/v1/chat/completions", chat)]
    for response in answers:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "too_many_values", response.text
    assert parses == []  # bounded before parsing: the 1.33 M ids and 100k messages never became objects
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


def test_a_big_body_is_parsed_once_and_off_the_event_loop(live: LiveDaemon) -> None:
    """/health answers while the body's parse is held on its worker, and the route never parses it again
    on the event loop (the thread named test-uvicorn)."""
    raw = json.dumps({"model": MODEL, "prompt": [1000 + i % 9000 for i in range(100_000)], "max_tokens": 2}).encode()
    assert len(raw) > BIG
    release = threading.Event()
    with _recorded_parses(hold=release) as (parses, started), ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_post, live, "/v1/completions", raw)
        try:
            assert started.wait(30), "the body was never parsed"
            health = httpx.get(live.url + "/health", timeout=10)
        finally:
            release.set()
        response = answer.result(timeout=60)
    assert health.status_code == 200
    # 100k ids fit the bounds; the context (4096) refuses them, after the one parse.
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded", response.text
    assert len(parses) == 1 and parses[0] != "test-uvicorn", parses
