"""The daemon's latency histograms per objective: the shipped alerts judge each objective against its own targets
(manifests/monitoring/prometheusrule.yaml), so a batch request within its 20 s never counts against a 1 s one."""
from __future__ import annotations

import pytest

from stallfree.node_daemon.engine.request import Objective, Request, RequestStatus
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.server.metrics import EngineMetrics


def served(metrics: EngineMetrics, objective: Objective | None, arrival: float, first: float, last: float) -> None:
    request = Request(f"r{arrival}", list(range(8)), SamplingParams(max_tokens=3), arrival_time=arrival,
                      objective=objective)
    request.first_scheduled_time = arrival + 0.25
    for index, t in enumerate((first, (first + last) / 2, last)):
        metrics.on_token(request, t, first=index == 0)
        request.append_output_token(7)
        request.first_token_time = request.first_token_time or t
        request.last_token_time = t
    request.status = RequestStatus.FINISHED_STOPPED
    metrics.on_finished(request, last)


def test_each_objective_has_its_own_latency_histograms() -> None:
    metrics = EngineMetrics("m")
    served(metrics, Objective("interactive", priority=10, deadline=1.8), arrival=1.0, first=2.0, last=2.2)
    served(metrics, Objective("batch", priority=-1), arrival=1.0, first=6.0, last=7.0)
    served(metrics, None, arrival=1.0, first=1.5, last=1.7)

    def sample(name: str, objective: str) -> float | None:
        return metrics.registry.get_sample_value(f"stallfree_objective_{name}", {"model_name": "m", "objective": objective})

    assert sample("time_to_first_token_seconds_sum", "interactive") == pytest.approx(1.0)
    assert sample("time_to_first_token_seconds_sum", "batch") == pytest.approx(5.0)
    assert sample("time_to_first_token_seconds_sum", "default") == pytest.approx(0.5)
    assert sample("time_per_output_token_seconds_sum", "batch") == pytest.approx(0.5)
    assert sample("request_queue_time_seconds_count", "interactive") == 1
    assert sample("time_to_first_token_seconds_bucket", "interactive") is None  # a bucket needs its le
    assert metrics.registry.get_sample_value("stallfree_objective_time_to_first_token_seconds_bucket",
                                             {"model_name": "m", "objective": "batch", "le": "2.5"}) == 0
    # The service-wide histograms still count every request.
    assert metrics.registry.get_sample_value("stallfree_time_to_first_token_seconds_count", {"model_name": "m"}) == 3
