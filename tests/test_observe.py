"""Observation: a live daemon's admin API read with timeouts; anything less than a full window is unknown."""
from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from control_helpers import stats
from server_helpers import ADMIN_TOKEN, free_port, running_daemon
from stallfree.operator.control.observe import NOT_READY, ReplicaTarget, classify, too_few_samples
from stallfree.operator.control.observe_http import HttpObserver

SIM_DAEMON = ["--backend", "sim", "--model", "llama-3-8b", "--hardware", "h100", "--max-model-len", "4096",
              "--max-token-budget", "1024", "--max-num-seqs-ceiling", "64", "--max-num-seqs", "32",
              "--token-budget", "256", "--stats-window-s", "30", "--profile-max-seconds", "5"]


@pytest.fixture(scope="module")
def daemon():
    with running_daemon(base_args=SIM_DAEMON) as live:
        yield live


@contextlib.asynccontextmanager
async def silent_server(reply: bytes | None):
    """A real socket that accepts and then never answers (reply None) or answers `reply` and closes."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        if reply is None:
            await asyncio.sleep(30)
        else:
            writer.write(reply)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


def test_classify_rules():
    target = ReplicaTarget("r0")
    assert classify(ReplicaTarget("r0", ready=False), stats(), None, 5).unknown_reason == NOT_READY
    assert classify(target, None, None, 5, "stats scrape failed: x").unknown_reason == "stats scrape failed: x"
    few = classify(target, stats(count=2), None, 5)
    assert not few.known and "too few samples" in few.unknown_reason and few.tuning is not None
    assert classify(target, stats(count=5), None, 5).known
    assert too_few_samples(stats(count=0), 1)  # an idle window is not a healthy one


async def test_a_live_daemon_is_known_once_its_window_has_samples(daemon):
    async with httpx.AsyncClient() as client:
        observer = HttpObserver(client, ADMIN_TOKEN, timeout_s=5.0, min_samples=5)
        quiet, = await observer.observe([ReplicaTarget("r0", daemon.url)], 0.0)
        assert quiet.stats is not None and quiet.profile is not None and quiet.profile.mixed
        if quiet.stats.ttft_ms.count < 5:
            assert not quiet.known and "too few samples" in quiet.unknown_reason
        for i in range(8):
            response = await client.post(f"{daemon.url}/v1/completions", timeout=30,
                                         json={"model": "llama-3-8b", "prompt": f"{i} hello " * 40, "max_tokens": 6})
            assert response.status_code == 200
        seen, = await observer.observe([ReplicaTarget("r0", daemon.url)], 0.0)
        assert seen.known and seen.stats.ttft_ms.count >= 8 and seen.stats.tpot_ms.p99 > 0
        assert seen.tuning.token_budget == 256 and seen.stats.ceilings.max_token_budget == 1024


async def test_every_way_of_not_reading_a_replica_is_unknown_with_its_reason(daemon):
    refused = f"http://127.0.0.1:{free_port()}"
    async with httpx.AsyncClient() as client, silent_server(None) as hanging, \
            silent_server(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot json!") as garbage:
        observer = HttpObserver(client, ADMIN_TOKEN, timeout_s=0.5, min_samples=1)
        wrong_token = HttpObserver(client, "not-the-token", timeout_s=2.0, min_samples=1)
        targets = [ReplicaTarget("starting", daemon.url, ready=False), ReplicaTarget("refused", refused),
                   ReplicaTarget("hanging", hanging), ReplicaTarget("garbage", garbage),
                   ReplicaTarget("no-address", None)]
        results = {o.name: o for o in await observer.observe(targets, 0.0)}
        assert results["starting"].unknown_reason == NOT_READY
        assert "stats scrape failed: ConnectError" in results["refused"].unknown_reason
        assert "timed out after 0.5s" in results["hanging"].unknown_reason
        assert "not JSON" in results["garbage"].unknown_reason
        assert results["no-address"].unknown_reason == "no address"
        assert all(not o.known and o.stats is None for o in results.values())
        denied, = await wrong_token.observe([ReplicaTarget("r0", daemon.url)], 0.0)
        assert denied.unknown_reason == "stats scrape failed: HTTP 401" and denied.stats is None
