"""The tuner's law, pure: start, multiplicative decrease, bounded raise, max_num_seqs, bounds, hysteresis."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from control_helpers import linear_profile, observation, stats
from stallfree.contracts import Ceilings, Tuning, min_budget_for, validate_tuning
from stallfree.operator.control.policy import ControlPolicy, SLOTargets, TuningBounds
from stallfree.operator.control.tuner import (BUDGET_LOWERED, BUDGET_RAISED, HOLD, INITIAL, REAPPLY, SEQS_LOWERED,
                                      ReplicaTunerState, TunerConfig, decide_tuning)
from stallfree.operator.control.learned_speed import LearnedSpeed
from stallfree.profile_rules import budget_for_tpot, calibrated_by

POLICY = ControlPolicy(slo=SLOTargets(ttft_p99_ms=2000, tpot_p99_ms=40, queue_wait_p99_ms=1000), window_s=10,
                       interval_s=10)


def settled(tuning: Tuning, **kw) -> ReplicaTunerState:
    return ReplicaTunerState(tuning=tuning, **kw)


def test_starts_at_the_profile_budget_for_a_fraction_of_the_tpot_slo():
    profile = linear_profile(overhead_ms=5, ms_per_token=0.05)  # 32 ms (0.8 x 40) at 540 tokens
    decision, state = decide_tuning(observation(window=stats(budget=256), profile=profile), None, POLICY, 10.0)
    assert decision.kind == INITIAL and decision.reason == "start_from_profile"
    assert decision.tuning.token_budget == budget_for_tpot(profile, 32.0, lo=1, margin=1.0) == 512
    assert state.tuning == decision.tuning


def test_starts_from_the_spec_budget_or_from_siblings():
    spec_policy = replace(POLICY, initial_token_budget=128)
    decision, _ = decide_tuning(observation(window=stats(budget=256, seqs=32), profile=linear_profile()), None,
                                spec_policy, 10.0)
    assert decision.tuning.token_budget == 128 and decision.reason == "start_from_spec"
    sibling = Tuning(token_budget=704, max_num_seqs=96)
    decision, _ = decide_tuning(observation(window=stats(budget=256)), None, POLICY, 10.0, seed=sibling)
    assert decision.tuning == sibling and decision.reason == "start_from_service"


def test_tpot_breach_lowers_the_budget_multiplicatively_and_remembers_the_limit():
    tuning = Tuning(token_budget=1024, max_num_seqs=64)
    window = stats(tpot=50.0, budget=1024, utilisation=0.95)
    # The profile as the loop hands it on: scaled by the window's 20 ms over the profile's t(0.95 x 1024).
    profile = calibrated_by(window, linear_profile())
    decision, state = decide_tuning(observation(window=window, profile=profile), settled(tuning), POLICY, 100.0)
    assert decision.kind == BUDGET_LOWERED and decision.reason == "tpot_breach"
    new = decision.tuning.token_budget
    assert 0.5 * 1024 <= new <= 0.85 * 1024
    # Sized by that profile to land at 75% of the SLO, only the prefill chunk shrinking: the decode step (10
    # running) stays.
    fixed = decode = profile.iteration_ms_at(10)

    def predicted(b: int) -> float:
        return fixed + (50.0 - fixed) * (profile.iteration_ms_at(b) - decode) / (profile.iteration_ms_at(1024) - decode)

    assert predicted(new) <= 30.0 + 1e-9 < predicted(new + 16)
    assert state.tpot_limit_budget == 1024 and decision.at_ceiling is True


def test_without_a_profile_the_decrease_is_still_bounded():
    tuning = Tuning(token_budget=1024, max_num_seqs=64)
    decision, _ = decide_tuning(observation(window=stats(tpot=400.0, budget=1024)), settled(tuning), POLICY, 100.0)
    assert decision.tuning.token_budget == 512  # x0.5 at most, however bad the breach


def test_dead_band_holds():
    tuning = Tuning(token_budget=512, max_num_seqs=64)
    window = stats(tpot=33.0, queue=900.0, utilisation=0.99, budget=512)  # between 70% and 100% of the SLO
    decision, state = decide_tuning(observation(window=window, profile=linear_profile()), settled(tuning), POLICY, 50)
    assert decision.kind == HOLD and decision.tuning == tuning
    assert decision.at_ceiling is True  # pressure, but TPOT leaves no room: the scaler may act


def test_raise_needs_slack_pressure_and_a_full_budget_and_is_bounded():
    tuning = Tuning(token_budget=256, max_num_seqs=64)
    profile = linear_profile()
    pressed = stats(tpot=12.0, queue=900.0, utilisation=0.97, budget=256)
    decision, _ = decide_tuning(observation(window=pressed, profile=profile), settled(tuning), POLICY, 50)
    assert decision.kind == BUDGET_RAISED and decision.reason == "prefill_pressure"
    assert 256 < decision.tuning.token_budget <= 512  # at most x2 per step
    assert decision.at_ceiling is False
    # No pressure, or a budget not fully used: nothing to gain from a raise.
    calm = replace(pressed, queue_wait_ms=stats(queue=10.0).queue_wait_ms, ttft_ms=stats(ttft=100.0).ttft_ms)
    assert decide_tuning(observation(window=calm, profile=profile), settled(tuning), POLICY, 50)[0].kind == HOLD
    loose = replace(pressed, budget_utilisation=0.4)
    decision, _ = decide_tuning(observation(window=loose, profile=profile), settled(tuning), POLICY, 50)
    assert decision.tuning.token_budget == 256 and decision.reason == "not_budget_bound"


def test_raise_stays_under_a_budget_that_breached():
    tuning = Tuning(token_budget=400, max_num_seqs=64)
    state = settled(tuning, tpot_limit_budget=480, tpot_limit_at=0.0)
    pressed = stats(tpot=10.0, queue=900.0, utilisation=0.97, budget=400)
    decision, _ = decide_tuning(observation(window=pressed, profile=linear_profile()), state, POLICY, 50)
    assert decision.kind == BUDGET_RAISED and decision.tuning.token_budget <= 0.9 * 480
    # The limit is forgotten once it is old.
    decision, _ = decide_tuning(observation(window=pressed, profile=linear_profile()), state, POLICY, 10_000)
    assert decision.tuning.token_budget > 480


def test_raise_capped_by_bounds_and_ceilings_reports_the_ceiling():
    policy = replace(POLICY, bounds=TuningBounds(max_token_budget=600))
    tuning = Tuning(token_budget=600, max_num_seqs=64)
    pressed = stats(tpot=10.0, queue=900.0, utilisation=0.97, budget=600, ceilings=Ceilings(4096, 256))
    decision, _ = decide_tuning(observation(window=pressed, profile=linear_profile()), settled(tuning), policy, 50)
    assert decision.kind == HOLD and decision.reason == "at_bounds" and decision.at_ceiling is True
    # The replica's own ceiling wins over a looser spec bound.
    tuning = Tuning(token_budget=512, max_num_seqs=64)
    pressed = replace(pressed, tuning=tuning, ceilings=Ceilings(512, 128))
    decision, _ = decide_tuning(observation(window=pressed, profile=linear_profile()), settled(tuning), POLICY, 50)
    assert decision.tuning.token_budget == 512 and decision.at_ceiling is True


def test_preemptions_lower_max_num_seqs_and_the_budget_floor_follows_it():
    tuning = Tuning(token_budget=512, max_num_seqs=128)
    window = stats(tpot=20.0, budget=512, seqs=128, preemptions=7, kv=0.97, running=120)
    decision, _ = decide_tuning(observation(window=window, profile=linear_profile()), settled(tuning), POLICY, 50)
    assert decision.kind == SEQS_LOWERED and decision.reason == "preemptions"
    assert decision.tuning.max_num_seqs < 128
    # A deep budget cut drags max_num_seqs below it so the floor min_budget_for(max_num_seqs) holds.
    tuning = Tuning(token_budget=200, max_num_seqs=160)
    window = stats(tpot=200.0, budget=200, seqs=160, utilisation=1.0)
    decision, _ = decide_tuning(observation(window=window), settled(tuning), POLICY, 50)
    assert decision.tuning.token_budget >= min_budget_for(decision.tuning.max_num_seqs)
    assert decision.tuning.max_num_seqs < 160


def test_queue_wait_with_kv_headroom_raises_max_num_seqs():
    tuning = Tuning(token_budget=1024, max_num_seqs=32)
    window = stats(tpot=10.0, queue=900.0, utilisation=0.4, budget=1024, seqs=32, running=32, kv=0.3)
    decision, _ = decide_tuning(observation(window=window, profile=linear_profile()), settled(tuning), POLICY, 50)
    assert decision.kind == "max_num_seqs_raised" and decision.tuning.max_num_seqs == 40


def test_waits_for_a_clean_window_after_a_change():
    tuning = Tuning(token_budget=512, max_num_seqs=64)
    state = settled(tuning, last_change_at=100.0)
    window = stats(tpot=80.0, budget=512, request_rate=5.0, generation_rate=500.0)  # 100 tokens x 48 ms = 4.8 s
    decision, _ = decide_tuning(observation(window=window), state, POLICY, 105.0)
    assert decision.kind == HOLD and decision.reason == "settling"
    decision, _ = decide_tuning(observation(window=window), state, POLICY, 115.0)
    assert decision.kind == BUDGET_LOWERED


def test_drift_is_reapplied_and_unknown_holds():
    desired = Tuning(token_budget=400, max_num_seqs=64)
    restarted = stats(budget=512)
    decision, _ = decide_tuning(observation(window=restarted), settled(desired), POLICY, 50)
    assert decision.kind == REAPPLY and decision.tuning == desired
    decision, state = decide_tuning(observation(window=None, unknown="stats scrape failed: timeout"),
                                    settled(desired), POLICY, 50)
    assert decision.kind == HOLD and decision.reason == "unknown" and decision.at_ceiling is None
    assert "timeout" in decision.message and state.tuning == desired
    off = replace(POLICY, tuning_enabled=False)
    decision, _ = decide_tuning(observation(window=stats(tpot=90.0, budget=512)), settled(desired), off, 50)
    assert decision.kind == HOLD and decision.tuning == Tuning(512, 64) and decision.reason == "tuning_off"


def test_converges_on_a_plant_and_settles_after_a_load_step():
    """Closed loop on a synthetic replica: p99 TPOT = (4 + 0.06 x budget) ms x load factor, prefill pressed."""
    profile = linear_profile()
    tuning, state, t = Tuning(token_budget=128, max_num_seqs=64), None, 0.0
    state = settled(tuning)
    budgets, factor = [], 1.0
    for step in range(60):
        t += 10.0
        if step == 30:
            factor = 1.5  # long prompts: the same budget now costs 50% more per iteration
        tpot = (4 + 0.06 * state.tuning.token_budget) * factor
        window = stats(tpot=tpot, queue=900.0, utilisation=0.97, tuning=state.tuning, request_rate=20.0,
                       generation_rate=400.0)
        decision, state = decide_tuning(observation(window=window, profile=profile), state, POLICY, t)
        budgets.append(state.tuning.token_budget)
    moves = [b2 - b1 for b1, b2 in zip(budgets, budgets[1:]) if b2 != b1]
    reversals = sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))
    assert reversals <= 1
    final_tpot = (4 + 0.06 * budgets[-1]) * 1.5
    assert 0.5 * 40 <= final_tpot <= 40  # under the SLO, and not starved
    assert budgets[25:30] == [budgets[29]] * 5  # settled before the step
    assert budgets[-10:] == [budgets[-1]] * 10  # settled after it


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(64, 4096), seqs=st.integers(1, 256), tpot=st.floats(1, 500), queue=st.floats(0, 20000),
       ttft=st.floats(0, 40000), util=st.floats(0, 1), kv=st.floats(0, 1), preempt=st.integers(0, 20),
       running=st.integers(0, 256), max_budget=st.integers(256, 4096), with_profile=st.booleans())
def test_every_decision_is_a_valid_tuning_inside_the_bounds(budget, seqs, tpot, queue, ttft, util, kv, preempt,
                                                            running, max_budget, with_profile):
    ceilings = Ceilings(max_budget, 256)
    bounds = POLICY.bounds.clipped(ceilings)
    start = Tuning(token_budget=min(max(budget, min_budget_for(seqs)), max_budget), max_num_seqs=seqs)
    if start.token_budget < min_budget_for(seqs):
        start = Tuning(token_budget=max_budget, max_num_seqs=max(1, max_budget // 2))
    window = stats(tpot=tpot, queue=queue, ttft=ttft, utilisation=util, kv=kv, preemptions=preempt,
                   running=running, tuning=start, ceilings=ceilings)
    obs = observation(window=window, profile=linear_profile() if with_profile else None)
    for state in (None, settled(start)):
        decision, _ = decide_tuning(obs, state, POLICY, 1000.0, config=TunerConfig())
        validate_tuning(decision.tuning, ceilings)
        assert bounds.min_token_budget <= decision.tuning.token_budget <= bounds.max_token_budget
        if state is not None and decision.kind in (BUDGET_LOWERED, BUDGET_RAISED):
            ratio = decision.tuning.token_budget / start.token_budget
            assert 0.5 * 0.9 <= ratio <= 2.0 + 1e-9


def steep_decode_profile() -> "Profile":
    """A CPU-like replica: the decode step grows 6 ms per sequence, prefill 0.05 ms per token on top."""
    from stallfree.contracts import Profile, ProfilePoint

    decode = [ProfilePoint(n, n, 6.0 * n) for n in (1, 2, 4, 8, 16, 32, 64)]
    mixed = [ProfilePoint(t, min(32, t // 2), 6.0 * min(32, t // 2) + 0.05 * t) for t in range(64, 2049, 64)]
    return Profile(device="cpu-like", decode_only=decode, mixed=mixed)


def test_a_decode_step_over_the_slo_lowers_max_num_seqs_not_the_budget_and_raises_it_back_with_room():
    profile = steep_decode_profile()
    policy = replace(POLICY, slo=SLOTargets(ttft_p99_ms=2000, tpot_p99_ms=100, queue_wait_p99_ms=1000))
    tuning = Tuning(token_budget=256, max_num_seqs=32)
    # 32 sequences decoding: 192 ms per step as the profile says (mostly-decode window), TPOT 200 ms > 100.
    window = stats(tpot=200.0, budget=256, seqs=32, running=32, utilisation=0.2, prefill_rate=50.0, decode_rate=160.0,
                   mean_iteration_ms=6.0 * 51, waiting=10)
    decision, state = decide_tuning(observation(window=window, profile=profile), settled(tuning), policy, 100.0)
    assert decision.kind == SEQS_LOWERED and decision.reason == "decode_bound"
    assert decision.tuning.token_budget == 256  # the budget is not what sets TPOT here
    new = decision.tuning.max_num_seqs
    assert new < 32 and "cannot restore" in decision.message
    assert state.decode_limited
    # Later the machine is quieter (decode steps at half the profile's time): TPOT well under the SLO, requests
    # waiting at the lower cap, KV free: max_num_seqs comes back up, as far as the calibrated decode step fits.
    later = stats(tpot=40.0, budget=256, seqs=new, running=new, utilisation=new / 256, prefill_rate=10.0,
                  decode_rate=300.0, mean_iteration_ms=3.0 * new, waiting=20, kv=0.3, tuning=decision.tuning)
    learned = LearnedSpeed().updated(window, profile).updated(later, profile)  # as the loop learns it
    raised, _ = decide_tuning(observation(window=later, profile=learned.apply(profile)), state, policy, 1000.0)
    assert raised.tuning.max_num_seqs > new and raised.tuning.token_budget == 256
