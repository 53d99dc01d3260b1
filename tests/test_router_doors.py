"""The router as the public door (issue 35), over real HTTP on loopback: `stallfree router` as a child process
in front of a fake replica (router_fakes.py) or sim daemons. One test per row of the issue's table."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest

from router_fakes import FAKE_CONTEXT, FAKE_MODEL, fake_replica
from server_helpers import ADMIN_TOKEN
from stallfree.net import free_port

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class LiveRouter:
    url: str
    port: int
    process: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def queue(self) -> dict:
        return httpx.get(self.url + "/router/queue", headers=ADMIN, timeout=5).json()


@contextlib.contextmanager
def live_router(urls: list[str], *extra: str) -> Iterator[LiveRouter]:
    port = free_port()
    env = dict(os.environ, STALLFREE_ADMIN_TOKEN=ADMIN_TOKEN)
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        process = subprocess.Popen([sys.executable, "-m", "stallfree.cli", "router", "--replicas", ",".join(urls),
                                    "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra],
                                   env=env, stdout=subprocess.DEVNULL, stderr=log)
    live = LiveRouter(f"http://127.0.0.1:{port}", port, process, log.name)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, live.log()
            assert time.monotonic() < deadline, "the router never got ready"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(live.url + "/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield live
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        assert "Traceback" not in live.log(), live.log()
        os.unlink(log.name)


def _raw(port: int, request: bytes, timeout_s: float = 5.0) -> bytes:
    """One request over a raw socket (no client library normalises its path); the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fake():
    with fake_replica() as replica:
        yield replica


@pytest.fixture(scope="module")
def doors(fake):
    with live_router([fake.url], "--max-body-bytes", str(1 << 20), "--header-timeout-s", "1", "--body-timeout-s",
                     "2", "--stream-stall-timeout-s", "1.5") as live:
        yield live


def test_deep_nesting_is_a_400_and_no_traceback(doors, fake):
    before = len(fake.inference_paths())
    body = b'{"model": "%s", "prompt": ' % FAKE_MODEL.encode() + b"[" * 1000 + b"]" * 1000 + b"}"
    response = httpx.post(doors.url + "/v1/completions", content=body, timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert "nested too deeply" in response.json()["error"]["message"]
    assert len(fake.inference_paths()) == before  # refused at the router


def test_a_body_past_the_limit_is_a_413_every_client_reads_and_never_reaches_a_replica(doors, fake):
    before, arrivals = len(fake.inference_paths()), doors.queue()["arrivals"]
    big = json.dumps({"model": FAKE_MODEL, "prompt": "x" * (8 << 20)}).encode()
    for _ in range(2):  # httpx writes the whole body before it reads: it still reads the 413
        response = httpx.post(doors.url + "/v1/completions", content=big, timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert len(fake.inference_paths()) == before
    assert doors.queue()["arrivals"] == arrivals


def test_a_body_of_too_many_values_is_refused_and_health_answers_meanwhile(doors):
    ids = json.dumps({"model": FAKE_MODEL, "prompt": [7] * 150_000}).encode()  # < 1 MiB, > 131,072 values
    assert len(ids) < 1 << 20
    results: list[int] = []

    def send() -> None:
        results.append(httpx.post(doors.url + "/v1/completions", content=ids, timeout=30,
                                  headers={"content-type": "application/json"}).status_code)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in threads):
        started = time.perf_counter()
        assert httpx.get(doors.url + "/health", timeout=5).status_code == 200
        worst = max(worst, time.perf_counter() - started)
    for t in threads:
        t.join()
    assert results == [400] * 4
    assert worst < 1.0, worst


def test_slow_headers_and_bodies_are_cut_and_idle_connections_closed(doors):
    with socket.create_connection(("127.0.0.1", doors.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished (slowloris)
        started = time.monotonic()
        answer = sock.recv(65536)
        assert _status(answer) == 408 and time.monotonic() - started < 5
    with socket.create_connection(("127.0.0.1", doors.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")  # the body stops
        started = time.monotonic()
        answer = sock.recv(65536)
        assert _status(answer) == 408 and time.monotonic() - started < 6


def test_the_connection_cap_keeps_probes_answered(fake):
    with live_router([fake.url], "--max-connections", "4", "--header-timeout-s", "30") as live:
        idle = [socket.create_connection(("127.0.0.1", live.port)) for _ in range(4)]
        try:
            time.sleep(0.3)
            assert _status(_raw(live.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
            ready = _raw(live.port, b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _status(ready) == 503 and b"connections full" in ready
            other = _raw(live.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _status(other) == 503 and b"too_many_connections" in other
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.parametrize("request_line", [
    b"GET /v1/%2e%2e/admin/stats", b"GET /v1/../metrics", b"PUT /v1/%2e%2e/admin/tuning", b"GET /admin/stats",
    b"GET /openapi.json", b"GET /v1//models", b"POST /v1/./completions", b"GET /v1/models/..%2f..%2fadmin%2fstats",
    b"GET /v1/completions/", b"GET /docs"])
def test_only_the_openai_api_and_the_routers_own_paths_are_served(doors, fake, request_line):
    before = len(fake.inference_paths())
    body = b'{"token_budget": 1}'
    answer = _raw(doors.port, request_line + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ADMIN_TOKEN.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert _status(answer) in (404, 405), answer[:200]
    assert len(fake.inference_paths()) == before


def test_a_model_id_path_is_forwarded_encoded(doors, fake):
    response = httpx.get(doors.url + f"/v1/models/{FAKE_MODEL}", timeout=5)
    assert response.status_code == 418  # the fake's "not a path I serve": it reached the replica as sent
    assert fake.inference_paths()[-1] == f"/v1/models/{FAKE_MODEL}"


def test_replica_addresses_only_to_an_admin_and_forwarding_headers_set_by_the_router(doors, fake):
    spoof = {"X-Forwarded-For": "6.6.6.6", "Forwarded": "for=6.6.6.6", "X-Real-IP": "6.6.6.6",
             "x-stallfree-router-queue-ms": "600000"}
    body = {"model": FAKE_MODEL, "prompt": "hi"}
    response = httpx.post(doors.url + "/v1/completions", json=body, headers=spoof, timeout=10)
    assert response.status_code == 200 and "x-stallfree-replica" not in response.headers
    headers = fake.inference()[-1][2]
    assert headers["x-forwarded-for"] == "127.0.0.1" and "forwarded" not in headers and "x-real-ip" not in headers
    assert float(headers["x-stallfree-router-queue-ms"]) < 60000
    assert httpx.post(doors.url + "/v1/completions", json=body, headers=ADMIN,
                      timeout=10).headers["x-stallfree-replica"] == fake.url.split("://")[1]
    assert httpx.get(doors.url + "/router/replicas", timeout=5).status_code == 401
    assert fake.url in str(httpx.get(doors.url + "/router/replicas", headers=ADMIN, timeout=5).json())
    ready = httpx.get(doors.url + "/ready", timeout=5).text
    assert fake.url.split("://")[1] not in ready


def test_demand_counts_only_requests_the_router_accepted(doors):
    before = doors.queue()
    refused = [
        httpx.post(doors.url + "/v1/completions", json={"model": "nope", "prompt": "x" * 4000}, timeout=10),
        httpx.post(doors.url + "/v1/completions", json=["not", "an", "object"], timeout=10),
        httpx.post(doors.url + "/v1/completions", content=b"{broken", timeout=10),
    ]
    assert [r.status_code for r in refused] == [404, 400, 400], [r.text for r in refused]
    assert refused[0].json()["error"]["code"] == "model_not_found"
    assert doors.queue()["arrived_prompt_tokens"] == before["arrived_prompt_tokens"]
    # A prompt far past the context counts as the context at most (the replica refuses the rest).
    httpx.post(doors.url + "/v1/completions", json={"model": FAKE_MODEL, "prompt": "x" * 400_000}, timeout=10)
    after = doors.queue()
    assert after["arrivals"] == before["arrivals"] + 1
    assert after["arrived_prompt_tokens"] - before["arrived_prompt_tokens"] == FAKE_CONTEXT


def test_a_client_that_leaves_a_non_streamed_request_aborts_it_on_the_replica(doors, fake):
    left = fake.left
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(doors.url + "/v1/completions", json={"model": FAKE_MODEL, "prompt": "x", "delay_s": 30},
                   timeout=httpx.Timeout(10, read=0.5))
    _wait_until(lambda: fake.left == left + 1, 3, "the replica saw its client leave")


def test_a_client_that_leaves_a_stream_aborts_it_on_the_replica(doors, fake):
    left = fake.left
    body = {"model": FAKE_MODEL, "prompt": "x", "stream": True, "events": 1000, "gap_s": 0.02}
    with httpx.stream("POST", doors.url + "/v1/completions", json=body, timeout=10) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 4:
                break
    _wait_until(lambda: fake.left == left + 1, 3, "the replica saw its client leave")


def test_a_stream_on_a_replica_that_stops_answering_ends_with_an_error_event(doors, fake):
    left = fake.left
    body = {"model": FAKE_MODEL, "prompt": "x", "stream": True, "events": 10, "hang": True}
    started = time.monotonic()
    with httpx.stream("POST", doors.url + "/v1/completions", json=body, timeout=10) as response:
        events = _events(response)
    assert 1.4 < time.monotonic() - started < 5
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "upstream_stalled"
    _wait_until(lambda: fake.left == left + 1, 3, "the hung upstream request was closed")


def test_shutdown_drains_ready_first_then_cuts_streams_with_an_error_and_done(fake):
    with live_router([fake.url], "--drain-timeout-s", "1.5") as live:
        short = {"model": FAKE_MODEL, "prompt": "x", "stream": True, "events": 10, "gap_s": 0.05}
        long = {"model": FAKE_MODEL, "prompt": "x", "stream": True, "events": 1000, "gap_s": 0.02}
        got: dict[str, list[str]] = {"short": [], "long": []}

        def stream(name: str, body: dict) -> None:
            with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=20) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        got[name].append(line[6:])

        waiting: list[httpx.Response] = []  # a non-streamed request still waiting for its answer at the cut
        threads = [threading.Thread(target=stream, args=(name, body)) for name, body in (("short", short),
                                                                                         ("long", long))]
        threads.append(threading.Thread(target=lambda: waiting.append(httpx.post(
            live.url + "/v1/completions", json={"model": FAKE_MODEL, "prompt": "x", "delay_s": 30}, timeout=20))))
        reached = len(fake.inference())
        for t in threads:
            t.start()
        _wait_until(lambda: got["short"] and got["long"] and len(fake.inference()) >= reached + 3, 10,
                    "all three reached the replica")
        live.process.send_signal(signal.SIGTERM)
        _wait_until(lambda: httpx.get(live.url + "/ready", timeout=5).status_code == 503, 5, "unready once draining")
        ready = httpx.get(live.url + "/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["reason"] == "draining"
        refused = httpx.post(live.url + "/v1/completions", json=short, timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        for t in threads:
            t.join(15)
        assert live.process.wait(timeout=10) == 0
        assert got["short"][-1] == "[DONE]" and all("error" not in e for e in got["short"])
        assert got["long"][-1] == "[DONE]" and json.loads(got["long"][-2])["error"]["code"] == "router_draining"
        assert waiting[0].status_code == 503 and waiting[0].json()["error"]["code"] == "draining"


def test_the_operators_router_drains_within_the_specs_drain_timeout_and_its_grace_period() -> None:
    from stallfree.cli.router import build_parser
    from stallfree.operator.reconcile import render
    from test_render import spec_with

    spec = spec_with(engine__drainTimeoutSeconds=45)
    pod = render.router_deployment("chat", "ns", spec)["spec"]["template"]["spec"]
    args = build_parser().parse_args(pod["containers"][0]["args"][1:])
    assert args.drain_timeout_s == 45.0
    assert pod["terminationGracePeriodSeconds"] > 45 + render.PRESTOP_SLEEP_S
