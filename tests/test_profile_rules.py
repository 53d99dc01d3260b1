"""profile_rules: the budget for a TPOT target, max_num_seqs giving way, prefill capacity and calibration."""
from __future__ import annotations

import random

import pytest

from control_helpers import stats
from stallfree.contracts import Profile, ProfilePoint, min_budget_for
from stallfree.profile_rules import (CALIBRATION_RANGE, MIN_TOKEN_BUDGET, SLO_MARGIN, budget_for_tpot, calibrated_by,
                                     decodes_per_iteration, give_way, observed_over_predicted, prefill_room,
                                     prefill_tokens_per_s, scaled)

PROFILE = Profile("test", decode_only=[ProfilePoint(1, 1, 4.0), ProfilePoint(32, 32, 8.0)],
                  mixed=[ProfilePoint(64, 16, 5.0), ProfilePoint(128, 16, 8.0), ProfilePoint(256, 16, 14.0),
                         ProfilePoint(512, 16, 30.0)])


def test_the_budget_is_the_largest_measured_point_within_the_margin_of_the_target():
    assert budget_for_tpot(PROFILE, 20.0) == 256  # 0.8 x 20 = 16 ms: 256 (14 ms) fits, 512 (30 ms) does not
    assert budget_for_tpot(PROFILE, 20.0, margin=1.0) == 256 and budget_for_tpot(PROFILE, 37.5) == 512
    assert budget_for_tpot(PROFILE, 12.0) == 128  # 9.6 ms lies between 128 and 256: a measured point, not a line
    assert budget_for_tpot(PROFILE, 1000.0, hi=300) == 300  # the ceiling caps it
    # Nothing fits: the smallest measured point, never under the default floor, and the ceiling wins over the floor.
    assert budget_for_tpot(PROFILE, 1.0) == 64 and budget_for_tpot(PROFILE, 1.0, lo=100) == 100
    assert budget_for_tpot(PROFILE, 1.0, lo=MIN_TOKEN_BUDGET, hi=40) == 40
    assert SLO_MARGIN == 0.8


def test_a_budget_never_shrinks_as_the_target_loosens():
    rng = random.Random(7)
    for _ in range(200):
        tokens = sorted(rng.sample(range(16, 2049), rng.randint(1, 8)))
        ms = sorted(rng.uniform(0.5, 200.0) for _ in tokens)
        profile = Profile("t", mixed=[ProfilePoint(t, 4, m) for t, m in zip(tokens, ms)])
        targets = sorted(rng.uniform(1.0, 300.0) for _ in range(5))
        budgets = [budget_for_tpot(profile, t) for t in targets]
        assert budgets == sorted(budgets)
        for target, budget in zip(targets, budgets):
            # What was measured at the budget fits, unless nothing did (then the smallest point or the floor).
            assert profile.iteration_ms_at(budget) <= SLO_MARGIN * target or budget == max(64, tokens[0])


def test_max_num_seqs_gives_way_to_the_budget_floor_before_the_budget_rises():
    assert give_way(512, 64, 1, 2048) == (512, 64)  # room already
    budget, seqs = give_way(64, 64, 1, 2048)
    assert (budget, seqs) == (64, 32) and min_budget_for(seqs) <= budget
    # At the sequences' floor the budget rises instead, but never past the ceiling.
    assert give_way(40, 64, 16, 2048) == (min_budget_for(16), 16)
    assert give_way(40, 64, 16, 44) == (44, 16)


def test_prefill_capacity_is_the_room_beside_the_decodes_over_the_full_budget_iteration():
    assert prefill_room(256, 16.0) == 240.0 and prefill_room(16, 40.0) == 0.0
    assert prefill_tokens_per_s(PROFILE, 256, 16.0) == pytest.approx(240 / 0.014)
    assert prefill_tokens_per_s(PROFILE, 256, 300.0) == 0.0  # decodes fill the budget: no prompt is prefilled
    # Decodes per iteration: the window's busy tokens split by its decode share; its running count when idle.
    busy = stats(budget=512, utilisation=0.5, prefill_rate=900.0, decode_rate=100.0, running=10)
    assert decodes_per_iteration(busy) == pytest.approx(0.5 * 512 * 0.1)
    idle = stats(prefill_rate=0.0, decode_rate=0.0, running=3)
    assert decodes_per_iteration(idle) == 3.0


def test_calibration_is_observed_over_predicted_for_what_the_window_ran_and_clamped():
    mixed = stats(budget=512, utilisation=0.5, prefill_rate=900.0, decode_rate=100.0, mean_iteration_ms=28.0)
    assert observed_over_predicted(mixed, PROFILE) == ("mixed", pytest.approx(2.0))  # 256 tokens: 14 ms predicted
    decodes = stats(budget=512, utilisation=32 / 512, prefill_rate=0.0, decode_rate=500.0, mean_iteration_ms=4.0)
    assert observed_over_predicted(decodes, PROFILE) == ("decode", pytest.approx(0.5))
    light = stats(budget=512, utilisation=0.2, prefill_rate=900.0, decode_rate=100.0)
    assert observed_over_predicted(light, PROFILE) is None  # a lightly used budget is mostly fixed overhead
    assert observed_over_predicted(mixed, None) is None
    stalled = stats(budget=512, utilisation=0.5, prefill_rate=900.0, decode_rate=100.0, mean_iteration_ms=1e6)
    assert observed_over_predicted(stalled, PROFILE)[1] == CALIBRATION_RANGE[1]
    # The profile as one window says the replica runs: every curve scaled by its ratio, once.
    assert calibrated_by(mixed, PROFILE) == scaled(PROFILE, 2.0)
    assert calibrated_by(light, PROFILE) is PROFILE
    assert scaled(PROFILE, 2.0).iteration_ms_at(256) == pytest.approx(28.0)
