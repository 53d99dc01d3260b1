"""The Prometheus observer reports arrived demand, not served throughput, and counts requests of every outcome."""
from __future__ import annotations

import asyncio
import shutil
import subprocess

import httpx
import pytest
import yaml

from stallfree.contracts import Ceilings
from stallfree.operator.control.observe import ReplicaTarget
from stallfree.operator.control.observe_prometheus import PrometheusObserver, arrived_demand, window_queries

WINDOW_S = 30.0
# One overloaded replica: it starts 1 request/s of 1,000-token prompts (its prefill ceiling), fails 0.25/s, refuses
# 0.5/s for a full queue, and its queue grew by 30 requests over the window.
OVERLOADED = {
    "up": 1.0, "token_budget": 256.0, "max_num_seqs": 32.0, "max_partial_prefills": 1.0,
    "finished_per_s": 1.0, "failed_per_s": 0.25, "refused_per_s": 0.5,
    "waiting_change": 30.0, "running_change": 0.0,
    "started_per_s": 1.0, "started_prompt_tokens_per_s": 1000.0,
    "started_total": 600.0, "started_prompt_tokens_total": 540_000.0,
    "ttft_ms.count": 30.0, "tpot_ms.count": 30.0, "itl_ms.count": 300.0, "queue_wait_ms.count": 30.0,
}


def fake_prometheus(values_by_key: dict[str, float], queries: dict[str, str], pod: str = "chat-0"):
    by_expr = {expr: key for key, expr in queries.items()}
    asked: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        expr = request.url.params["query"]
        asked.append(expr)
        key = by_expr[expr]
        result = [] if key not in values_by_key else [{"metric": {"pod": pod}, "value": [0, str(values_by_key[key])]}]
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": result}})

    return httpx.MockTransport(handle), asked


def observe(values: dict[str, float]):
    queries = window_queries('namespace="test"', WINDOW_S, "pod")
    transport, asked = fake_prometheus(values, queries)

    async def run():
        async with httpx.AsyncClient(transport=transport) as client:
            observer = PrometheusObserver(client, "http://prometheus", 'namespace="test"', WINDOW_S,
                                          Ceilings(512, 64), min_samples=1)
            return await observer.observe([ReplicaTarget("chat-0")], 0.0)

    return asyncio.run(run())[0], asked


def test_under_overload_demand_is_what_arrived_not_what_was_served():
    seen, _ = observe(OVERLOADED)
    assert seen.known
    # Arrived: 1.25 ended + 0.5 refused + 30 queued / 30 s = 2.75 requests/s of 1,000-token prompts.
    assert seen.stats.prompt_tokens_per_s == pytest.approx(2750.0)
    assert seen.stats.prompt_tokens_per_s > OVERLOADED["started_prompt_tokens_per_s"]  # the served figure
    # Every request the engine took, failed ones too (the old query read successes only: 1.0).
    assert seen.stats.request_rate == pytest.approx(1.25)


def test_a_queue_that_drains_shows_demand_below_throughput():
    draining = dict(OVERLOADED, refused_per_s=0.0, failed_per_s=0.0, waiting_change=-15.0)
    seen, _ = observe(draining)
    assert seen.stats.prompt_tokens_per_s == pytest.approx(500.0)  # (1.0 - 15 / 30) * 1,000


def test_with_nothing_started_in_the_window_the_lifetime_mean_prompt_sizes_the_arrivals():
    stalled = dict(OVERLOADED, started_per_s=0.0, started_prompt_tokens_per_s=0.0, finished_per_s=0.0,
                   failed_per_s=0.0, refused_per_s=1.0, waiting_change=0.0)
    seen, _ = observe(stalled)
    assert seen.stats.prompt_tokens_per_s == pytest.approx(900.0)  # 1 refused/s x 540,000 / 600


def test_arrived_demand_without_any_prompt_length_falls_back_to_what_was_served():
    assert arrived_demand(2.0, 1.0, 0.0, 30.0, 0.0, 0.0, None) == (3.0, 0.0)
    assert arrived_demand(0.0, 0.0, -90.0, 30.0, 100.0, 1.0, None) == (0.0, 0.0)  # never negative


def test_the_queries_read_every_outcome_and_the_queue_and_keep_the_selector():
    queries = window_queries('namespace="test"', WINDOW_S, "pod")
    assert 'stallfree_request_errors_total{namespace="test", reason=~"queue_full|draining"}' in queries["refused_per_s"]
    assert 'reason=~"engine|internal"' in queries["failed_per_s"]
    assert queries["waiting_change"].startswith("sum by (pod) (delta(stallfree_num_requests_waiting")
    assert "invalid_request" not in " ".join(queries.values())  # a client's bad request is not demand
    bare = window_queries("", WINDOW_S, "pod")
    assert 'stallfree_request_errors_total{reason=~"queue_full|draining"}' in bare["refused_per_s"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool checks the PromQL")
def test_promtool_parses_every_query(tmp_path):
    queries = window_queries('namespace="test", service="chat"', WINDOW_S, "pod")
    rules = [{"record": f"stallfree:observer:{key.replace('.', '_')}", "expr": expr} for key, expr in queries.items()]
    path = tmp_path / "observer.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "observer", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
