"""EngineMetrics: the stallfree_* series, their model label, millisecond buckets and what feeds them."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stallfree.contracts import Tuning
from stallfree.node_daemon.engine.engine_protocol import IterationRecord
from stallfree.node_daemon.server.metrics import TOKEN_LATENCY_BUCKETS, EngineMetrics
from stallfree.node_daemon.engine.request import Request, RequestStatus
from stallfree.node_daemon.engine.sampling_params import SamplingParams

MODEL = "tiny-test"


def value(metrics: EngineMetrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})
    assert got is not None, f"no sample {name} {labels}"
    return got


def test_required_series_exist_with_model_name_label() -> None:
    metrics = EngineMetrics(MODEL)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    required = [
        "stallfree_time_to_first_token_seconds", "stallfree_time_per_output_token_seconds",
        "stallfree_inter_token_latency_seconds", "stallfree_request_queue_time_seconds",
        "stallfree_request_prefill_time_seconds", "stallfree_request_decode_time_seconds",
        "stallfree_e2e_request_latency_seconds", "stallfree_iteration_time_seconds",
        "stallfree_iteration_prefill_tokens", "stallfree_iteration_decode_tokens", "stallfree_iteration_tokens",
        "stallfree_num_requests_running", "stallfree_num_requests_waiting", "stallfree_num_partial_prefills",
        "stallfree_kv_cache_usage_ratio", "stallfree_prefix_cache_queries", "stallfree_prefix_cache_hits",
        "stallfree_preemptions", "stallfree_prompt_tokens", "stallfree_generation_tokens",
        "stallfree_request_success", "stallfree_request_errors", "stallfree_token_budget", "stallfree_max_num_seqs",
    ]
    missing = [name for name in required if name not in families]
    assert not missing, missing
    for family in families.values():
        assert family.name.startswith("stallfree_")
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, sample


def test_token_latency_buckets_resolve_milliseconds() -> None:
    below_10ms = [b for b in TOKEN_LATENCY_BUCKETS if b < 0.010]
    assert len(below_10ms) >= 3 and min(TOKEN_LATENCY_BUCKETS) <= 0.001


def test_iteration_record_feeds_gauges_histograms_and_counters() -> None:
    metrics = EngineMetrics(MODEL)
    metrics.on_iteration(IterationRecord(start=0.0, duration_s=0.004, num_prefill_tokens=200, num_decode_tokens=56,
                                         token_budget=256, max_num_seqs=64, num_running=56, num_waiting=7,
                                         num_partial_prefills=2, kv_usage=0.375, num_preempted=3))
    assert value(metrics, "stallfree_num_requests_running") == 56
    assert value(metrics, "stallfree_num_requests_waiting") == 7
    assert value(metrics, "stallfree_num_partial_prefills") == 2
    assert value(metrics, "stallfree_kv_cache_usage_ratio") == 0.375
    assert value(metrics, "stallfree_token_budget") == 256
    assert value(metrics, "stallfree_max_num_seqs") == 64
    assert value(metrics, "stallfree_preemptions_total") == 3
    assert value(metrics, "stallfree_iterations_total") == 1
    assert value(metrics, "stallfree_iteration_time_seconds_bucket", le="0.005") == 1
    assert value(metrics, "stallfree_iteration_time_seconds_bucket", le="0.0025") == 0
    assert value(metrics, "stallfree_iteration_tokens_bucket", le="256.0") == 1
    assert value(metrics, "stallfree_iteration_tokens_bucket", le="128.0") == 0
    assert value(metrics, "stallfree_iteration_prefill_tokens_sum") == 200
    assert value(metrics, "stallfree_iteration_decode_tokens_sum") == 56


def test_request_lifecycle_feeds_latency_and_token_series() -> None:
    metrics = EngineMetrics(MODEL)
    req = Request("r1", list(range(32)), SamplingParams(max_tokens=4), arrival_time=10.0)
    req.num_cached_tokens = 16
    req.first_scheduled_time = 10.5
    for i, t in enumerate([11.0, 11.02, 11.04, 11.10]):
        metrics.on_token(req, t, first=(i == 0))
        req.append_output_token(7)
        req.first_token_time = req.first_token_time or t
        req.last_token_time = t
    req.status = RequestStatus.FINISHED_STOPPED
    metrics.on_finished(req, 11.10)

    assert value(metrics, "stallfree_time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(metrics, "stallfree_request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(metrics, "stallfree_request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert value(metrics, "stallfree_request_decode_time_seconds_sum") == pytest.approx(0.1)
    assert value(metrics, "stallfree_e2e_request_latency_seconds_sum") == pytest.approx(1.1)
    assert value(metrics, "stallfree_inter_token_latency_seconds_count") == 3
    assert value(metrics, "stallfree_inter_token_latency_seconds_sum") == pytest.approx(0.1)
    assert value(metrics, "stallfree_inter_token_latency_seconds_bucket", le="0.025") == 2
    assert value(metrics, "stallfree_time_per_output_token_seconds_sum") == pytest.approx(0.1 / 3)
    assert value(metrics, "stallfree_generation_tokens_total") == 4
    assert value(metrics, "stallfree_prompt_tokens_total") == 32
    assert value(metrics, "stallfree_prefix_cache_queries_total") == 32
    assert value(metrics, "stallfree_prefix_cache_hits_total") == 16
    assert value(metrics, "stallfree_request_success_total", finished_reason="stop") == 1
    assert value(metrics, "stallfree_request_success_total", finished_reason="length") == 0


def test_errors_by_reason_and_tuning_gauges() -> None:
    metrics = EngineMetrics(MODEL)
    metrics.record_error("queue_full")
    metrics.record_error("queue_full")
    metrics.record_error("something_new")
    assert value(metrics, "stallfree_request_errors_total", reason="queue_full") == 2
    assert value(metrics, "stallfree_request_errors_total", reason="something_new") == 1
    metrics.set_tuning(Tuning(token_budget=384, max_num_seqs=32, max_partial_prefills=2, long_prefill_threshold=128))
    assert value(metrics, "stallfree_token_budget") == 384
    assert value(metrics, "stallfree_max_num_seqs") == 32
    assert value(metrics, "stallfree_max_partial_prefills") == 2
    assert value(metrics, "stallfree_long_prefill_threshold") == 128


def test_two_daemons_in_one_process_do_not_collide() -> None:
    a, b = EngineMetrics("a"), EngineMetrics("b")
    a.record_error("internal")
    assert b.registry.get_sample_value("stallfree_request_errors_total", {"model_name": "b", "reason": "internal"}) == 0
