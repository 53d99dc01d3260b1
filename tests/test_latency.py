"""One definition of TTFT, TPOT, ITL and queue wait (common/latency.py), and the daemon's two readers agree on it."""
from __future__ import annotations

import pytest

from stallfree import latency
from stallfree.contracts import Ceilings, Tuning
from stallfree.node_daemon.engine.request import Request, RequestStatus
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.measure.stats_window import StatsWindow
from stallfree.node_daemon.server.metrics import EngineMetrics


def test_the_definitions() -> None:
    assert latency.ttft_s(10.0, 10.25) == pytest.approx(0.25)
    assert latency.queue_wait_s(10.0, None) is None
    assert latency.queue_wait_s(10.0, 10.1) == pytest.approx(0.1)
    assert latency.itl_s(11.0, 11.02) == pytest.approx(0.02)
    assert latency.tpot_s(11.0, 11.3, 4) == pytest.approx(0.1)
    assert latency.tpot_s(11.0, 11.0, 1) is None  # one token: no gap to average
    assert latency.tpot_s(None, None, 5) is None


def _one_request(observers) -> None:
    req = Request("r", list(range(8)), SamplingParams(max_tokens=4), arrival_time=10.0)
    req.first_scheduled_time = 10.2
    for i, t in enumerate([10.5, 10.52, 10.56, 10.62]):
        for o in observers:
            o.on_token(req, t, i == 0)
        req.append_output_token(7)
        req.first_token_time = req.first_token_time or t
        req.last_token_time = t
    req.status = RequestStatus.FINISHED_STOPPED
    for o in observers:
        o.on_finished(req, 10.62)


def test_metrics_and_the_stats_window_report_the_same_latencies() -> None:
    metrics, window = EngineMetrics("tiny"), StatsWindow(30.0, clock=lambda: 11.0)
    _one_request([metrics, window])
    stats = window.snapshot(Tuning(token_budget=64, max_num_seqs=4), Ceilings(max_token_budget=64, max_num_seqs=4),
                            now=11.0)
    reg = metrics.registry
    label = {"model_name": "tiny"}

    def total(name: str) -> float:
        return reg.get_sample_value(name + "_sum", label)

    assert stats.ttft_ms.max == pytest.approx(total("stallfree_time_to_first_token_seconds") * 1000)
    assert stats.ttft_ms.max == pytest.approx(latency.ttft_s(10.0, 10.5) * 1000)
    assert stats.tpot_ms.max == pytest.approx(total("stallfree_time_per_output_token_seconds") * 1000)
    assert stats.tpot_ms.max == pytest.approx(latency.tpot_s(10.5, 10.62, 4) * 1000)
    assert stats.queue_wait_ms.max == pytest.approx(total("stallfree_request_queue_time_seconds") * 1000)
    assert stats.itl_ms.count == 3
    assert sum([0.02, 0.04, 0.06]) == pytest.approx(total("stallfree_inter_token_latency_seconds"))
