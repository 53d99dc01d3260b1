"""The one rule goodput counts by (stallfree.latency.within_targets): the loadgen, the simulator's request
outcomes and SLOs, and the sinusoid scenario's goodput all call it."""
from __future__ import annotations

from stallfree.latency import within_targets


def test_each_target_is_judged_only_when_given():
    assert within_targets(900.0, 80.0, 2000.0)  # no target: nothing to miss
    assert within_targets(900.0, 50.0, 100.0, ttft_target_ms=1000.0, tpot_target_ms=60.0, queue_wait_target_ms=100.0)
    assert not within_targets(1001.0, 50.0, ttft_target_ms=1000.0)
    assert not within_targets(900.0, 61.0, ttft_target_ms=1000.0, tpot_target_ms=60.0)
    assert not within_targets(900.0, 50.0, 101.0, queue_wait_target_ms=100.0)


def test_an_unmeasured_ttft_or_wait_misses_but_a_one_token_reply_cannot_miss_tpot():
    assert not within_targets(None, 50.0, ttft_target_ms=1000.0)
    assert not within_targets(900.0, 50.0, None, queue_wait_target_ms=100.0)
    assert within_targets(900.0, None, ttft_target_ms=1000.0, tpot_target_ms=60.0)
