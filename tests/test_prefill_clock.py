"""The router's per-replica prefill clock (operator/router/prefill_clock.py): what is still queued, as time passes."""
from __future__ import annotations

from stallfree.operator.router.prefill_clock import PrefillClock


def test_what_was_sent_drains_at_the_rate_in_dispatch_order():
    clock = PrefillClock()
    assert clock.dispatched("a", 1000, 1000.0, now_s=0.0) == 1.0
    assert clock.dispatched("b", 500, 1000.0, now_s=0.2) == 1.5  # starts when a ends
    assert clock.queued_tokens(1000.0, now_s=0.2) == 1300  # 800 of a + all of b
    assert clock.queued_tokens(1000.0, now_s=0.5) == 1000  # 500 of a + 500 of b
    assert clock.queued_tokens(1000.0, now_s=1.2) == 300
    assert clock.queued_tokens(1000.0, now_s=2.0) == 0  # predicted done, first bytes not back yet
    assert clock.queued_tokens(10_000.0, now_s=0.2) == 1500  # never more than was sent and not answered


def test_a_first_byte_moves_the_later_requests_by_the_prediction_error():
    slow = PrefillClock()
    slow.dispatched("a", 1000, 1000.0, now_s=0.0)
    slow.dispatched("b", 1000, 1000.0, now_s=0.0)
    slow.prefilled("a", now_s=1.5)  # half a second late: b is too
    assert slow.busy_until_s == 2.5
    assert slow.queued_tokens(1000.0, now_s=1.5) == 1000

    fast = PrefillClock()
    fast.dispatched("a", 1000, 1000.0, now_s=0.0)
    fast.dispatched("b", 1000, 1000.0, now_s=0.0)
    fast.prefilled("a", now_s=0.5)  # early: b starts early
    assert fast.busy_until_s == 1.5
    assert fast.queued_tokens(1000.0, now_s=1.0) == 500


def test_the_last_first_byte_or_a_failure_leaves_nothing_queued():
    clock = PrefillClock()
    clock.dispatched("a", 1000, 1000.0, now_s=0.0)
    clock.dispatched("b", 1000, 1000.0, now_s=0.0)
    clock.forget("b", now_s=0.1)  # failed before its first byte: its share goes
    assert clock.busy_until_s == 1.0 and clock.pending_tokens == 1000
    clock.prefilled("a", now_s=0.4)
    assert len(clock) == 0 and clock.queued_tokens(1000.0, now_s=0.4) == 0
    # An idle replica's next request starts now, not at a stale prediction.
    assert clock.dispatched("c", 100, 1000.0, now_s=0.5) == 0.6
