"""bench kv-estimate reads the daemon's real /metrics exposition: the reserved-KV gauge and the eviction counter."""
from __future__ import annotations

from prometheus_client import generate_latest

from stallfree.bench.kv_estimate import parse_metrics, report
from stallfree.node_daemon.engine.engine_protocol import IterationRecord
from stallfree.node_daemon.server.metrics import EngineMetrics


def record(kv_reserved: float, evicted: int) -> IterationRecord:
    return IterationRecord(start=0.0, duration_s=0.05, num_prefill_tokens=0, num_decode_tokens=32, token_budget=512,
                           max_num_seqs=64, num_running=32, num_waiting=0, num_partial_prefills=0, kv_usage=0.1,
                           num_preempted=0, kv_reserved=kv_reserved, num_evicted_blocks=evicted)


def test_the_reserved_gauge_and_evictions_reach_the_exposition_the_bench_parses():
    metrics = EngineMetrics("smollm2-135m")
    metrics.on_iteration(record(0.4, 3))
    metrics.on_iteration(record(0.35, 2))
    values = parse_metrics(generate_latest(metrics.registry).decode())
    assert values["stallfree_kv_cache_reserved_ratio"] == 0.35  # a gauge: the latest iteration
    assert values["stallfree_kv_cache_evictions_total"] == 5  # a counter: every iteration's evictions
    assert values["stallfree_num_requests_running"] == 32 and values["stallfree_iterations_total"] == 2


def test_the_report_names_every_figure():
    result = {"url": "http://x", "model": "m", "chats": 2, "completed": 2, "finish": {"stop": 2},
              "chat_output_tokens": [5, 9], "peak_running": 2, "peak_waiting": 0, "max_num_seqs": 64,
              "peak_kv_reserved": 0.4, "peak_kv_usage": 0.1, "preemptions": 0, "evictions": 0, "iterations": 10,
              "mean_iteration_ms": 50.0, "short_iterations": 3, "wall_s": 1.0,
              "short": {"name": "short", "latency_s": 0.2, "error": None, "finish_reason": "length"}}
    text = report(result)
    assert "2 sent, 2 completed" in text and "peak running 2 (max_num_seqs 64)" in text
    assert "latency 0.20 s, 3 iterations from send to finish" in text
