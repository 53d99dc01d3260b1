"""SIGTERM drains a real `stallfree serve` subprocess (sim backend): streams finish, new work gets 503, exit 0."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from server_helpers import free_port

MODEL = "llama-3-8b"


def _spawn(drain_timeout_s: float, tmp_path) -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", STALLFREE_ADMIN_TOKEN="drain-test")
    log = open(tmp_path / "daemon.log", "wb")
    cmd = [sys.executable, "-m", "stallfree.cli", "serve", "--backend", "sim", "--model", MODEL, "--hardware", "h100",
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs-ceiling", "64", "--max-token-budget", "512",
           "--token-budget", "256", "--no-profile", "--drain-timeout-s", str(drain_timeout_s), "--log-level", "warning"]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"daemon exited at start-up: {(tmp_path / 'daemon.log').read_text()}")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return process, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError("daemon never became ready")


async def _read_stream(client: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> dict:
    body = {"model": MODEL, "prompt": "drain me gently", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[dict] = []
    done = False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
                continue
            events.append(json.loads(line[len("data: "):]))
            started.set()
    return {"done": done, "events": events}


def _stop(process: subprocess.Popen, log) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
    log.close()


def test_sigterm_lets_streams_finish_and_refuses_new_requests(tmp_path) -> None:
    process, url, log = _spawn(drain_timeout_s=30, tmp_path=tmp_path)
    try:
        async def scenario() -> tuple[list[dict], httpx.Response, httpx.Response, float]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                started = [asyncio.Event() for _ in range(4)]
                streams = [asyncio.ensure_future(_read_stream(client, 300, ev)) for ev in started]
                await asyncio.gather(*(ev.wait() for ev in started))
                process.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                ready = await client.get("/ready")
                while ready.status_code == 200 and time.monotonic() - t0 < 5:
                    await asyncio.sleep(0.02)
                    ready = await client.get("/ready")
                refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "too late"})
                results = await asyncio.gather(*streams)
                return results, ready, refused, time.monotonic() - t0

        results, ready, refused, drained_in = asyncio.run(scenario())
        assert ready.status_code == 503 and ready.json()["reason"] == "draining"
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        for result in results:  # every in-flight stream ran to its end
            assert result["done"]
            assert result["events"][-1]["usage"]["completion_tokens"] == 300
            assert result["events"][-2]["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=30) == 0  # a completed drain is a clean exit
        assert drained_in < 30
    finally:
        _stop(process, log)


def test_grace_period_over_aborts_what_is_left(tmp_path) -> None:
    process, url, log = _spawn(drain_timeout_s=1.0, tmp_path=tmp_path)
    try:
        async def scenario() -> dict:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                started = asyncio.Event()
                stream = asyncio.ensure_future(_read_stream(client, 6000, started))  # far longer than the grace
                await started.wait()
                process.send_signal(signal.SIGTERM)
                return await stream

        t0 = time.monotonic()
        result = asyncio.run(scenario())
        assert time.monotonic() - t0 < 15
        assert result["done"]
        assert result["events"][-1]["error"]["code"] == "aborted"  # told why, not cut off silently
        assert process.wait(timeout=15) == 0
    finally:
        _stop(process, log)
