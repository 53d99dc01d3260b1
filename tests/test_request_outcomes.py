"""Goodput over a simulated run: a request is good when served within every target of its objective; shed, refused
and lost ones are not. The bands' reserve shedding predicts with."""
from __future__ import annotations

import pytest

from stallfree.operator.router.objectives import Objective, Objectives
from stallfree.operator.router.shedding import REPLICA_RESERVE_DEVIATIONS, BandArrivals, reserved_tokens_per_ms
from stallfree.simulator.request_outcomes import SHED, Outcomes

INTERACTIVE = Objective("interactive", 0, ttft_ms=1000.0, tpot_ms=50.0, queue_wait_ms=500.0)
BATCH = Objective("batch", -1, ttft_ms=30000.0)
OBJECTIVES = Objectives({o.name: o for o in (INTERACTIVE, BATCH)}, INTERACTIVE)


def _served(outcomes: Outcomes, key: int, arrival: float, dispatched: float, first: float, end: float,
            objective: str = "interactive", tenant: str = "a", tokens: int = 11) -> None:
    outcomes.arrived(key, arrival, objective, tenant, 1000, tokens)
    outcomes.dispatched(key, dispatched)
    outcomes.first_token(key, first)
    outcomes.ended(key, end)


def test_goodput_counts_only_requests_within_every_target():
    o = Outcomes(OBJECTIVES)
    _served(o, 1, 0.0, 0.1, 0.5, 0.9)  # TTFT 500, TPOT 40, wait 100: good
    _served(o, 2, 0.0, 0.1, 1.5, 1.9)  # TTFT 1500: late
    _served(o, 3, 0.0, 0.1, 0.5, 1.5)  # TPOT 100: too slow
    _served(o, 4, 0.0, 0.6, 0.8, 1.0)  # waited 600 ms in the router
    o.arrived(5, 0.0, "interactive", "a", 1000, 11)
    o.lost(5, 2.0)
    o.refused(0.0, "batch", "b", 500, SHED)
    summary = o.summary()
    assert summary["interactive"]["good"] == 1 and summary["interactive"]["requests"] == 5
    assert summary["interactive"]["goodput"] == pytest.approx(0.2)
    assert summary["interactive"]["served_late"] == 1 and summary["interactive"]["lost"] == 1
    assert summary["batch"]["shed"] == 1
    assert summary["batch"]["goodput"] == 0.0
    assert o.summary(tenant="b").keys() == {"batch"}


def test_what_the_higher_bands_offered_ages_out_of_the_window():
    bands = BandArrivals(window_s=30.0)
    bands.offered(0.0, 0, 1000)
    bands.offered(20.0, 0, 1000)
    bands.offered(21.0, -1, 5000)  # its own band: not reserved against it
    at_25 = bands.reserved_tokens_per_ms(-1, 25.0, 30.0)
    assert at_25 == pytest.approx(reserved_tokens_per_ms(2, 2000.0, 2e6, 25.0, 30.0))
    # The replica's part of the wait is reserved with fewer deviations than the router queue's.
    reserve = bands.reserve(-1, 25.0, 30.0)
    assert reserve.router == pytest.approx(at_25)
    assert reserve.replica == pytest.approx(reserved_tokens_per_ms(2, 2000.0, 2e6, 25.0, 30.0,
                                                                   REPLICA_RESERVE_DEVIATIONS))
    assert reserved_tokens_per_ms(2, 2000.0, 2e6, 25.0, 30.0, 0.0) < reserve.replica < reserve.router
    assert bands.reserved_tokens_per_ms(-1, 35.0, 30.0) == pytest.approx(
        reserved_tokens_per_ms(1, 1000.0, 1e6, 30.0, 30.0))  # the first aged out
    assert bands.reserved_tokens_per_ms(0, 35.0, 30.0) == 0.0  # nothing above the top band
    for t in range(100, 200):  # no sheddable request asks: what it keeps stays one window's
        bands.offered(float(t), 0, 10)
    assert len(bands) == 30


def test_the_reserve_is_the_higher_bands_rate_plus_its_spread():
    # 100 requests of 1000 tokens over 10 s: 10,000 tok/s, spread sqrt(1e8/10 * (1/10 + 1/10)) = 1414 tok/s.
    assert reserved_tokens_per_ms(100, 1e5, 1e8, 10.0, 10.0, deviations=0.0) == pytest.approx(10.0)
    assert reserved_tokens_per_ms(100, 1e5, 1e8, 10.0, 10.0, deviations=1.0) == pytest.approx(10.0 + 1.4142, rel=1e-4)
    assert reserved_tokens_per_ms(0, 0.0, 0.0, 10.0, 10.0) == 0.0
