"""The router's outcomes per objective (objective_outcomes.py): p99s over a sliding window, counters since start."""
from __future__ import annotations

import pytest

from stallfree.operator.router.objective_outcomes import ObjectiveOutcomes


def test_p99s_are_over_the_window_and_the_counters_over_the_routers_life():
    outcomes = ObjectiveOutcomes(window_s=10.0)
    for i in range(100):  # TTFTs 1..100 ms, one every 0.1 s, within a 1 s target but the last
        outcomes.first_byte("chat", i * 0.1, float(i + 1), target_ms=99.5)
        outcomes.dispatched("chat", i * 0.1, float(i))
    now = outcomes.figures("chat", 9.95)
    assert (now["completed"], now["good"]) == (100, 99)
    assert (now["p99_ttft_ms"], now["p99_queue_wait_ms"]) == (99.0, 98.0)  # nearest rank over the window
    later = outcomes.figures("chat", 15.0)  # the first half has left the window: only 51..100 ms stay
    assert later["p99_ttft_ms"] == 100.0 and later["completed"] == 100
    assert outcomes.figures("chat", 30.0)["p99_ttft_ms"] is None  # nothing answered lately: unknown, not 0
    assert outcomes.figures("batch", 5.0) == {"completed": 0, "good": 0, "p99_ttft_ms": None,
                                              "p99_queue_wait_ms": None}


def test_an_objective_without_a_ttft_target_counts_every_answer_good():
    outcomes = ObjectiveOutcomes()
    outcomes.first_byte("best-effort", 1.0, 50_000.0, target_ms=None)
    assert outcomes.figures("best-effort", 1.0)["good"] == 1


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        ObjectiveOutcomes(window_s=0.0)
