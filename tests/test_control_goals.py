"""The closed-loop goals gate: `stallfree control` exits non-zero when any scenario misses any goal."""
from __future__ import annotations

import json
from dataclasses import replace

from stallfree.cli import control
from stallfree.simulator import closed_loop_scenarios as scenarios
from stallfree.simulator.closed_loop_judge import judge


def _never_tuned() -> scenarios.Scenario:
    """small-budget with the tuner off: a budget far too small stays, queue wait never comes back."""
    base = scenarios.small_budget()
    return replace(base, name="never-tuned", policy=replace(base.policy, tuning_enabled=False), duration_s=90)


def test_a_scenario_that_misses_a_goal_makes_the_command_exit_non_zero(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(scenarios.SCENARIOS, "never-tuned", (_never_tuned, scenarios.summarize_load_change))
    out = tmp_path / "r.json"
    code = control.main(["--scenario", "never-tuned", "--quiet", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 1
    assert not result["ok"] and any(m.startswith("goal ") for m in result["missed"])
    assert "[missed] goal:" in capsys.readouterr().out


def test_goals_are_computed_from_the_windows():
    slo = {"tpot_p99_ms": 100.0, "queue_wait_p99_ms": 1000.0, "ttft_p99_ms": 2000.0}

    def row(t: float, qw: float, replicas: int = 1) -> dict:
        return {"t": t, "p99_tpot_ms": 50.0, "p99_queue_wait_ms": qw, "p99_ttft_ms": qw + 100, "replicas": replicas,
                "desired_replicas": replicas, "ready_replicas": replicas, "replica_detail": []}

    held = [row(t, 500.0 if t != 20 else 1500.0) for t in range(10, 410, 10)]
    judged = judge(held, slo, 10.0, load_changes=1)
    assert judged["goals"]["backlog_drained_within_3_intervals_of_ready"]
    assert judged["goals"]["95pct_windows_within_every_feasible_slo"]  # 38 of 39 windows after the breach
    slipping = [row(t, 500.0 if t < 20 or t % 100 else 1500.0) for t in range(10, 410, 10)]
    judged = judge(slipping, slo, 10.0, load_changes=1)
    assert not judged["goals"]["95pct_windows_within_every_feasible_slo"]  # 4 breaches in 39


def test_restore_counts_from_when_the_new_replicas_are_ready_not_from_the_step_that_asked():
    slo = {"tpot_p99_ms": 100.0, "queue_wait_p99_ms": 1000.0, "ttft_p99_ms": 2000.0}

    def row(t, qw, replicas, desired, ready):
        return {"t": t, "p99_tpot_ms": 50.0, "p99_queue_wait_ms": qw, "p99_ttft_ms": qw, "replicas": replicas,
                "desired_replicas": desired, "ready_replicas": ready, "replica_detail": []}

    rows = [row(10, 500, 1, 1, 1), row(20, 5000, 1, 3, 1), row(30, 5000, 3, 3, 1), row(40, 5000, 3, 3, 3),
            row(50, 5000, 3, 3, 3), row(60, 900, 3, 3, 3), row(70, 500, 3, 3, 3)]
    restore = judge(rows, slo, 10.0, load_changes=1)["slos"]["queue_wait"]["restores"][0]
    assert restore["breach_s"] == 20 and restore["restored_s"] == 60
    assert restore["intervals_after_ready"] == 2.0  # ready at 40, not at 20 (the asking step showed 1 of 1 ready)


def test_a_restore_reports_when_its_backlog_drained_and_when_that_leaves_the_window():
    slo = {"tpot_p99_ms": 100.0, "queue_wait_p99_ms": 1000.0, "ttft_p99_ms": 2000.0}

    def row(t, qw, ready, router_queued, waiting):
        return {"t": t, "p99_tpot_ms": 50.0, "p99_queue_wait_ms": qw, "p99_ttft_ms": qw, "replicas": 3 if t > 20 else 1,
                "desired_replicas": 3, "ready_replicas": ready, "router_queued": router_queued,
                "replica_detail": [{"name": "r0", "known": True, "num_waiting": waiting}]}

    # Ready at 40; the router's queue empties at 50 but r0 still holds 4 waiting; nothing waits from 60 on.
    rows = [row(20, 5000, 1, 30, 3), row(30, 5000, 1, 40, 3), row(40, 5000, 3, 12, 3), row(50, 5000, 3, 0, 4),
            row(60, 5000, 3, 0, 1), row(70, 5000, 3, 0, 0), row(80, 5000, 3, 0, 0), row(90, 900, 3, 0, 0)]
    restore = judge(rows, slo, 10.0, load_changes=1, window_s=30.0)["slos"]["queue_wait"]["restores"][0]
    assert restore["backlog_drained_s"] == 60
    assert restore["backlog_window_clear_intervals_after_ready"] == 5.0  # 60 + 30 s, from ready at 40
    assert restore["intervals_after_ready"] == 5.0  # restored at 90: as soon as the window let it
    assert restore["backlog_drained_intervals_after_ready"] == 2.0  # drained at 60, from ready at 40
    tpot = judge(rows, slo, 10.0, load_changes=1, window_s=30.0)["slos"]["tpot"]
    assert tpot["restores"] == []


def test_the_restore_goal_is_the_backlog_drained_within_3_intervals_of_ready_not_the_window_clearing():
    slo = {"tpot_p99_ms": 100.0, "queue_wait_p99_ms": 1000.0, "ttft_p99_ms": 2000.0}

    def row(t, qw, ready, router_queued, waiting):
        return {"t": t, "p99_tpot_ms": 50.0, "p99_queue_wait_ms": qw, "p99_ttft_ms": qw, "replicas": 3 if t > 20 else 1,
                "desired_replicas": 3, "ready_replicas": ready, "router_queued": router_queued,
                "replica_detail": [{"name": "r0", "known": True, "num_waiting": waiting}]}

    # Ready at 40, drained at 60 (2 intervals): the 30 s window holds the backlog until 90 (5 intervals).
    held = [row(20, 5000, 1, 30, 3), row(30, 5000, 1, 40, 3), row(40, 5000, 3, 12, 3), row(50, 5000, 3, 0, 4),
            row(60, 5000, 3, 0, 1), row(70, 5000, 3, 0, 0), row(80, 5000, 3, 0, 0), row(90, 900, 3, 0, 0)]
    judged = judge(held, slo, 10.0, load_changes=1, window_s=30.0)
    assert judged["goals"]["backlog_drained_within_3_intervals_of_ready"]
    assert judged["slos"]["queue_wait"]["worst_intervals_after_ready"] == 2.0
    # Still queued 4 intervals after ready (drained at 80): missed, whenever the window clears.
    slow = [row(20, 5000, 1, 30, 3), row(30, 5000, 1, 40, 3), row(40, 5000, 3, 30, 3), row(50, 5000, 3, 20, 4),
            row(60, 5000, 3, 10, 3), row(70, 5000, 3, 4, 2), row(80, 900, 3, 0, 0), row(90, 900, 3, 0, 0)]
    judged = judge(slow, slo, 10.0, load_changes=1, window_s=30.0)
    assert not judged["goals"]["backlog_drained_within_3_intervals_of_ready"]
    assert judged["slos"]["queue_wait"]["restores"][0]["backlog_drained_intervals_after_ready"] == 4.0
