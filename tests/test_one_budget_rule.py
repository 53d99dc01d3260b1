"""The daemon's start, `/admin/profile`'s suggestion, feasibility and the tuner's first decision are one rule.

A daemon started with --tpot-slo-ms picks its tuning from its profile (measure/profiler.starting_tuning) and
`/admin/profile` suggests that budget; the operator's first step for a new replica picks one too (tuner,
start_from_profile), and feasibility names the largest budget the TPOT target allows. All come from
profile_rules.budget_for_tpot; under the operator's default bounds they must agree, or every new replica would be
re-tuned at once by a PUT the daemon did not need.
"""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from control_helpers import observation, stats
from stallfree.contracts import Ceilings, Percentiles, Profile, ProfilePoint, Tuning, min_budget_for
from stallfree.node_daemon.measure.profiler import starting_tuning, suggest_token_budget
from stallfree.operator.control.feasibility import TPOT, assess
from stallfree.operator.control.policy import ControlPolicy, SLOTargets
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
@given(profiles(), st.floats(1.0, 300.0, allow_nan=False), st.integers(32, 4096), st.integers(1, 256))
def test_the_daemon_admin_profile_feasibility_and_the_tuner_agree_under_the_default_bounds(
        profile, tpot_slo_ms, max_budget, max_num_seqs) -> None:
    ceilings = Ceilings(max_token_budget=max_budget, max_num_seqs=256)
    running = Tuning(token_budget=max(min_budget_for(max_num_seqs), min(512, max_budget)), max_num_seqs=max_num_seqs)
    if running.token_budget > max_budget:
        return  # no daemon starts with these ceilings
    daemon = starting_tuning(profile, tpot_slo_ms, ceilings, running)
    assert suggest_token_budget(profile, tpot_slo_ms, ceilings, running) == daemon.token_budget
    policy = ControlPolicy(slo=SLOTargets(tpot_p99_ms=tpot_slo_ms))  # the default bounds
    # The new replica reports what it started with, over too few requests yet to judge (as at every start).
    window = replace(stats(ceilings=ceilings, tuning=daemon, count=1), tpot_ms=Percentiles(count=1))
    feasibility = assess([observation(window=window, profile=profile)], policy)
    decision, state = decide_tuning(observation(window=window, profile=profile, unknown="1 of 5 samples"), None,
                                    policy, 10.0, feasibility=feasibility)
    assert decision.reason == "start_from_profile"
    assert state.tuning.token_budget == feasibility.tpot_budget  # always: one rule at the target the tuner aims at
    if TPOT not in feasibility.infeasible:  # else the tuner aims at the closest reachable TPOT, which the daemon cannot know
        assert state.tuning == daemon
        assert decision.kind == HOLD  # nothing to PUT: the daemon already runs the tuner's start
