"""Bounded loopback load: 64 concurrent streams with random disconnects, and a live budget change under load."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import LiveDaemon, running_daemon

MODEL = "tiny"


@pytest.fixture(scope="module")
def live() -> LiveDaemon:
    # Tokens per iteration must follow the budget here: no chunk cut for its prefix's cost.
    with running_daemon(["--no-prefix-cut"]) as live:
        yield live


async def _stream(client: httpx.AsyncClient, body: dict, disconnect_after: int | None) -> dict:
    """Read one SSE stream; disconnect after `disconnect_after` events (None: read to [DONE])."""
    events, finish, usage, done = 0, None, None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            if disconnect_after is not None and events >= disconnect_after:
                break  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                done = True
                continue
            data = json.loads(line[len("data: "):])
            assert "error" not in data, data
            events += 1
            if data["choices"]:
                finish = data["choices"][0]["finish_reason"] or finish
            if data.get("usage"):
                usage = data["usage"]
    return {"done": done, "finish": finish, "usage": usage, "cancelled": disconnect_after is not None}


def test_64_streams_with_random_disconnects_free_every_kv_block(live: LiveDaemon) -> None:
    rng = random.Random(7)
    max_tokens = 40
    plans = []
    for i in range(64):
        prompt = [rng.randrange(16, 500) for _ in range(rng.randrange(8, 120))]
        # A quarter of the clients leave: some before the first token, most mid-stream.
        leave = rng.choice([0, 1, 3, 6, 10]) if i % 4 == 0 else None
        plans.append(({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0.8, "stream_options": {"include_usage": True}}, leave))

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, body, leave) for body, leave in plans))

    start = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - start < 120
    completed = [r for r in results if not r["cancelled"]]
    assert len(completed) == 48
    for r in completed:
        assert r["done"] and r["finish"] == "length"
        assert r["usage"]["completion_tokens"] == max_tokens

    live.wait_idle()
    kv = live.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks, "a disconnected client's KV blocks were not freed"
    assert live.llm_engine.scheduler.num_running == 0 and live.llm_engine.scheduler.num_waiting == 0
    assert live.daemon.admission.queued_requests == 0 and not live.daemon.drain.in_flight
    aborted = live.daemon.metrics.registry.get_sample_value(
        "stallfree_request_success_total", {"model_name": MODEL, "finished_reason": "abort"})
    assert 1 <= aborted <= 16


def test_non_streaming_client_that_gives_up_is_aborted(live: LiveDaemon) -> None:
    def aborted() -> float:
        return live.daemon.metrics.registry.get_sample_value(
            "stallfree_request_success_total", {"model_name": MODEL, "finished_reason": "abort"})

    before = aborted()
    body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 1900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=0.3)
    live.wait_idle(timeout_s=30)
    assert aborted() == before + 1  # ended by the abort, not by running to max_tokens
    kv = live.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def _iteration_counts(live: LiveDaemon) -> dict[str, float]:
    text = httpx.get(live.url + "/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "stallfree_iterations_total":
                out["iterations"] = sample.value
            elif sample.name == "stallfree_iteration_tokens_bucket":
                out["le" + sample.labels["le"]] = sample.value
            elif sample.name == "stallfree_iteration_tokens_count":
                out["count"] = sample.value
            elif sample.name == "stallfree_token_budget":
                out["budget"] = sample.value
    return out


def test_budget_put_under_load_shows_in_tokens_per_iteration(live: LiveDaemon) -> None:
    admin = live.admin_headers
    before = httpx.get(live.url + "/admin/tuning", headers=admin).json()
    assert before["token_budget"] == 256
    rng = random.Random(3)
    prompts = [[rng.randrange(16, 500) for _ in range(1600)] for _ in range(8)]

    async def run() -> tuple[list[dict], dict, dict]:
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            tasks = [asyncio.ensure_future(client.post("/v1/completions", json={
                "model": MODEL, "prompt": p, "max_tokens": 8, "ignore_eos": True})) for p in prompts]
            # Let prefill run at the old budget for a while.
            while _iteration_counts(live).get("le256.0", 0) - _iteration_counts(live).get("le128.0", 0) < 5:
                await asyncio.sleep(0.01)
            put = await client.put("/admin/tuning", json={"token_budget": 96}, headers=admin)
            assert put.status_code == 200 and put.json()["token_budget"] == 96
            after_put = _iteration_counts(live)
            while _iteration_counts(live)["iterations"] < after_put["iterations"] + 12:
                await asyncio.sleep(0.01)
            later = _iteration_counts(live)
            responses = await asyncio.gather(*tasks)
            return [r.json() for r in responses], after_put, later

    try:
        bodies, after_put, later = asyncio.run(run())
    finally:
        httpx.put(live.url + "/admin/tuning", json=before, headers=admin)

    def over_128(c: dict) -> float:
        return c["count"] - c["le128.0"]

    # At most the iteration already running when the PUT landed (and the one it was queued behind) used the old budget.
    assert over_128(later) - over_128(after_put) <= 2
    # ... and prefill went on at the new budget: iterations of 65..128 tokens.
    assert (later["le128.0"] - later["le64.0"]) - (after_put["le128.0"] - after_put["le64.0"]) >= 8
    assert later["budget"] == 96
    for body in bodies:  # no request lost
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 8
    live.wait_idle()
