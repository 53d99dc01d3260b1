"""The one wait-until-ready loop: ready at once, ready later, a process that exits, a deadline."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest

from stallfree.ready import (ExitedBeforeReady, NotReadyInTime, answers_ready, answers_ready_async, wait_until_ready,
                             wait_until_ready_async)


def _after(n: int):
    """A predicate that holds from its n-th call on."""
    calls = {"n": 0}

    def ready() -> bool:
        calls["n"] += 1
        return calls["n"] >= n

    return ready, calls


def test_waits_until_ready_and_reports_progress():
    ready, calls = _after(3)
    waited: list[float] = []
    wait_until_ready(ready, 5.0, poll_s=0.01, on_wait=waited.append)
    assert calls["n"] == 3 and len(waited) == 2 and waited == sorted(waited)


def test_a_dead_process_ends_the_wait_at_once_not_at_the_deadline():
    started = time.monotonic()
    with pytest.raises(ExitedBeforeReady, match="replica r-0 exited"):
        wait_until_ready(lambda: False, 30.0, alive=lambda: False, poll_s=0.01, what="replica r-0")
    assert time.monotonic() - started < 10.0  # far below the 30 s deadline, with room for a busy machine


def test_the_deadline_raises_a_timeout():
    started = time.monotonic()
    with pytest.raises(NotReadyInTime, match="not ready after"):
        wait_until_ready(lambda: False, 0.1, poll_s=0.02)
    assert 0.1 <= time.monotonic() - started < 10.0
    assert issubclass(NotReadyInTime, TimeoutError) and issubclass(ExitedBeforeReady, RuntimeError)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        wait_until_ready(lambda: True, -1.0)
    with pytest.raises(ValueError):
        wait_until_ready(lambda: True, 1.0, poll_s=0.0)


async def test_async_form_takes_a_predicate_or_a_coroutine_function():
    ready, calls = _after(2)
    await wait_until_ready_async(ready, 5.0, poll_s=0.01)
    assert calls["n"] == 2

    async def coro_ready() -> bool:
        return True

    await wait_until_ready_async(coro_ready, 1.0)
    with pytest.raises(ExitedBeforeReady):
        await wait_until_ready_async(lambda: False, 30.0, alive=lambda: False)
    with pytest.raises(NotReadyInTime):
        await wait_until_ready_async(lambda: False, 0.05, poll_s=0.01)


class _Ready(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/ready" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server_url():
    server = HTTPServer(("127.0.0.1", 0), _Ready)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_answers_ready_reads_the_status_and_counts_no_server_as_not_ready(server_url):
    from stallfree.net import free_port

    nobody = f"http://127.0.0.1:{free_port()}"
    assert answers_ready(server_url) and not answers_ready(nobody, timeout_s=0.5)
    assert not answers_ready(server_url + "/missing")  # /missing/ready answers 404
    async with httpx.AsyncClient() as client:
        assert await answers_ready_async(client, server_url)
        assert not await answers_ready_async(client, nobody, timeout_s=0.5)
