"""The predictable-load scenarios' pieces (simulator/closed_loop_scenarios_predictable.py): the sinusoid's phases,
goodput from the simulated requests, and ramp's goal read off a timeline."""
from __future__ import annotations

from types import SimpleNamespace

import stallfree.simulator.closed_loop_scenarios_predictable as predictable
from stallfree.operator.control.policy import SLOTargets
from stallfree.simulator.closed_loop_scenarios import SCENARIOS, ramp
from stallfree.simulator.workload import parse_length


def test_the_sinusoid_runs_1x_to_24x_over_its_period():
    length = parse_length("uniform:100:200")
    phases = predictable.sinusoid_phases(0.25, 1.0, 24.0, 600.0, 20, 1200.0, length, length)
    rates = [p.rate for p in phases]
    assert len(phases) == 40 and phases[20].start_s == 600.0
    assert min(rates) < 0.25 * 1.2 and max(rates) > 0.25 * 23  # the step means come close to 1x and 24x
    assert all(abs(a - b) < 1e-9 for a, b in zip(rates[:20], rates[20:]))  # periodic
    assert "sinusoid" in SCENARIOS and SCENARIOS["ramp"][1] is predictable.summarize_ramp


def test_goodput_is_the_share_meeting_every_slo_unfinished_counting_as_missed():
    slo = SLOTargets(ttft_p99_ms=3000, tpot_p99_ms=100, queue_wait_p99_ms=2000)

    def rec(ttft, tpot, wait):
        return SimpleNamespace(ttft_s=ttft, tpot_s=tpot, queue_wait_s=wait)

    records = [rec(1.0, 0.05, 0.5), rec(3.5, 0.05, 0.5), rec(1.0, 0.2, 0.5), rec(1.0, None, 2.5), rec(2.0, None, 1.0)]
    assert predictable.goodput(records, slo) == 2 / 5
    assert predictable.goodput(records, slo, unfinished=5) == 2 / 10
    assert predictable.goodput([], slo) is None


def test_ramps_goal_counts_windows_once_the_starts_backlog_left_the_window():
    scenario = ramp()
    slo = scenario.policy.slo

    def row(t, qw, queued=0):
        return {"t": t, "p99_ttft_ms": qw, "p99_tpot_ms": 50.0, "p99_queue_wait_ms": qw, "router_queued": queued,
                "replica_detail": [], "replicas": 1, "desired_replicas": 1, "ready_replicas": 1}

    over = slo.queue_wait_p99_ms * 2
    rows = [row(10, 100), row(20, over, 30), row(30, over, 10), row(40, over), row(50, over), row(60, over)]
    rows += [row(t, 100) for t in range(70, 1210, 10)]
    run = SimpleNamespace(steps=[])
    original = predictable.timeline
    try:
        predictable.timeline = lambda _: rows
        summary, _ = predictable.summarize_ramp(scenario, run)
        assert summary["start_backlog_drained_s"] == 40 and summary["judged_from_s"] == 70
        assert summary["scenario_goals"]["no_window_over_slo_while_climbing_once_start_drained"]
        rows[50] = row(rows[50]["t"], over)  # one window over while the load climbs
        summary, _ = predictable.summarize_ramp(scenario, run)
        assert not summary["scenario_goals"]["no_window_over_slo_while_climbing_once_start_drained"]
    finally:
        predictable.timeline = original
