"""The router's outcomes per objective (objective_outcomes.py): p99s over a sliding window, counters since start."""
from __future__ import annotations

import pytest

from stallfree.operator.router.objective_outcomes import ObjectiveOutcomes
from stallfree.operator.router.objectives import Objective

CHAT = Objective("chat", ttft_ms=99.5, queue_wait_ms=90.0)


def test_p99s_are_over_the_window_and_the_counters_over_the_routers_life():
    outcomes = ObjectiveOutcomes(window_s=10.0)
    for i in range(100):  # TTFTs 1..100 ms, one every 0.1 s, within the target but the last
        wait_ms = 95.0 if i == 50 else 0.0  # one waited past its queue-wait target
        outcomes.first_byte(CHAT, i * 0.1, float(i + 1), wait_ms)
        outcomes.dispatched("chat", i * 0.1, float(i))
    outcomes.unserved("chat")  # a request answered without a replica: judged, not good
    now = outcomes.figures("chat", 9.95)
    assert (now["completed"], now["good"]) == (101, 98)
    assert (now["p99_ttft_ms"], now["p99_queue_wait_ms"]) == (99.0, 98.0)  # nearest rank over the window
    later = outcomes.figures("chat", 15.0)  # the first half has left the window: only 51..100 ms stay
    assert later["p99_ttft_ms"] == 100.0 and later["completed"] == 101
    assert outcomes.figures("chat", 30.0)["p99_ttft_ms"] is None  # nothing answered lately: unknown, not 0
    assert outcomes.figures("batch", 5.0) == {"completed": 0, "good": 0, "p99_ttft_ms": None,
                                              "p99_queue_wait_ms": None}


def test_an_objective_without_targets_counts_every_answer_good():
    outcomes = ObjectiveOutcomes()
    outcomes.first_byte(Objective("best-effort"), 1.0, 50_000.0, 10_000.0)
    assert outcomes.figures("best-effort", 1.0)["good"] == 1


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        ObjectiveOutcomes(window_s=0.0)
