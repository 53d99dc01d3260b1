"""The daemon's starting budget and the tuner's are one rule: the same budget for the same profile and TPOT SLO.

A daemon started with --tpot-slo-ms picks its tuning from its profile (measure/profiler.starting_tuning); the
operator's first step for a new replica picks one too (tuner, start_from_profile). Were they to differ, every new
replica would be re-tuned at once by a PUT the daemon did not need.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from control_helpers import observation, stats
from stallfree.contracts import Ceilings, Profile, ProfilePoint, Tuning, min_budget_for
from stallfree.node_daemon.measure.profiler import MIN_STARTING_SEQS, starting_tuning
from stallfree.operator.control.policy import ControlPolicy, SLOTargets, TuningBounds
from stallfree.operator.control.tuner import HOLD, decide_tuning


@st.composite
def profiles(draw) -> Profile:
    """Mixed curves as a profiler measures them: a few points, rising, and sometimes a noisy dip."""
    tokens = sorted(draw(st.sets(st.integers(16, 2048), min_size=1, max_size=8)))
    ms = draw(st.lists(st.floats(0.5, 200.0, allow_nan=False), min_size=len(tokens), max_size=len(tokens)))
    if draw(st.booleans()):
        ms = sorted(ms)  # monotone, the usual case
    return Profile(device="test", mixed=[ProfilePoint(t, min(4, t // 2), m) for t, m in zip(tokens, ms)])


@settings(max_examples=300, deadline=None)
@given(profiles(), st.floats(1.0, 300.0, allow_nan=False), st.integers(128, 4096), st.integers(1, 256))
def test_the_daemon_and_the_tuner_start_at_the_same_tuning(profile, tpot_slo_ms, max_budget, max_num_seqs) -> None:
    ceilings = Ceilings(max_token_budget=max_budget, max_num_seqs=256)
    running = Tuning(token_budget=max(min_budget_for(max_num_seqs), min(512, max_budget)), max_num_seqs=max_num_seqs)
    if running.token_budget > max_budget:
        return  # no daemon starts with these ceilings
    daemon = starting_tuning(profile, tpot_slo_ms, ceilings, running)
    # The service's bounds as loose as the daemon's own: the ceilings, and max_num_seqs' start-up floor.
    policy = ControlPolicy(slo=SLOTargets(tpot_p99_ms=tpot_slo_ms),
                           bounds=TuningBounds(min_token_budget=1, min_num_seqs=min(max_num_seqs, MIN_STARTING_SEQS)))
    # The new replica reports what it started with, over too few requests yet to judge (as at every start).
    window = stats(ceilings=ceilings, tuning=daemon, count=1)
    decision, state = decide_tuning(observation(window=window, profile=profile, unknown="1 of 5 samples"), None,
                                    policy, 10.0)
    assert decision.reason == "start_from_profile"
    assert state.tuning == daemon
    assert decision.kind == HOLD  # nothing to PUT: the daemon already runs the tuner's start
