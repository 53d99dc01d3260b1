"""TPOT feasibility under prefill load (pure): when the calibrated smallest iteration that carries a chunk
already breaks the SLO at this load, TPOT is infeasible (SLOFeasible=False, with the numbers) and the
tuner holds near the closest reachable TPOT; a window the smallest budget can restore never raises it.

The profile is SmolLM2-135M's on one core of this machine; the windows are shaped like those of a busy
`up --demo` run (iterations 2.6x slower than the profile, the budget fully used by long prompts)."""
from __future__ import annotations

from stallfree.contracts import Ceilings, Percentiles, Profile, ProfilePoint, Tuning, WindowStats
from stallfree.operator.control.feasibility import TPOT, assess
from stallfree.operator.control.loop import feasibility_condition
from stallfree.operator.control.observe import ReplicaObservation
from stallfree.operator.control.policy import ControlPolicy, ScalingPolicy, SLOTargets, TuningBounds
from stallfree.operator.control.scaler import ScaleDecision
from stallfree.operator.control.tuner import BUDGET_LOWERED, ReplicaTunerState, decide_tuning
from stallfree.profile_rules import calibrated_by

PROFILE = Profile("cpu", decode_only=[ProfilePoint(n, n, ms) for n, ms in
                                      ((1, 20.0), (2, 24.3), (4, 29.2), (8, 47.2), (16, 72.7))],
                  mixed=[ProfilePoint(t, 0, ms) for t, ms in ((64, 125.4), (128, 211.0), (256, 407.0),
                                                              (512, 905.8))])
POLICY = ControlPolicy(slo=SLOTargets(ttft_p99_ms=16000, tpot_p99_ms=264, queue_wait_p99_ms=9700),
                       bounds=TuningBounds(64, 512, 1, 32), scaling=ScalingPolicy(min_replicas=1, max_replicas=2),
                       interval_s=5, window_s=20)


def window(budget: int, tpot_p99: float, slowdown: float, prefill_tps: float = 200.0, decode_tps: float = 15.0,
           utilisation: float = 1.0, waiting: int = 20) -> WindowStats:
    """A window whose iterations ran `slowdown` x the profile's time for the tokens they carried."""
    mean_ms = slowdown * PROFILE.iteration_ms_at(round(utilisation * budget))
    return WindowStats(window_s=20, ttft_ms=Percentiles(30, 900, 5000, 8000, 9000),
                       tpot_ms=Percentiles(30, 0.8 * tpot_p99, 0.95 * tpot_p99, tpot_p99, tpot_p99),
                       itl_ms=Percentiles(300, 100, 300, 400, 500), queue_wait_ms=Percentiles(30, 500, 3000, 6000, 7000),
                       request_rate=1.5, prompt_tokens_per_s=prefill_tps, generation_tokens_per_s=decode_tps,
                       prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps,
                       budget_utilisation=utilisation, kv_usage=0.1, preemptions=0, num_waiting=waiting,
                       num_running=6, tuning=Tuning(budget, 16), ceilings=Ceilings(512, 32), iterations=60,
                       mean_iteration_ms=mean_ms)


def observe(stats: WindowStats) -> ReplicaObservation:
    """The replica as the loop hands it on after its first window: the profile scaled by what that window saw."""
    return ReplicaObservation("r0", True, stats, calibrated_by(stats, PROFILE), None)


def test_a_calibrated_smallest_iteration_over_the_slo_makes_tpot_infeasible_with_its_numbers():
    # Budget 80, p99 TPOT 350 ms, iterations 2.6x the profile: the decode-only floor (2.6 x 20 ms) is far
    # under 264 ms, but at budget 64 an iteration takes 2.6 x 125 ms = 326 ms and most of a request's
    # iterations carry a chunk: no setting reaches 264 ms at this load.
    obs = observe(window(80, 350.0, 2.6))
    f = assess([obs], POLICY)
    assert f.tpot_floor_ms < 100.0
    assert TPOT in f.infeasible and f.tpot_reachable_ms > 264.0
    assert "under what this load allows" in f.message and "smallest budget 64" in f.message
    assert f.tpot_target_ms >= f.tpot_reachable_ms / 0.75 - 1e-6
    cond = feasibility_condition(f, [obs], [], ScaleDecision(2, 2, "hold", "steady", "", False), POLICY)
    assert cond.status == "False" and cond.reason == "SLOInfeasible" and "264 ms" in cond.message


def test_an_infeasible_tpot_holds_the_budget_instead_of_sliding_it_to_the_floor():
    # At budget 80 the p99 TPOT of 350 ms is within a third of the closest reachable: the tuner holds there.
    stats = window(80, 350.0, 2.6)
    obs = observe(stats)
    f = assess([obs], POLICY)
    assert TPOT in f.infeasible
    state = ReplicaTunerState(tuning=stats.tuning)
    decision, _ = decide_tuning(obs, state, POLICY, now=100.0, feasibility=f)
    assert decision.kind != BUDGET_LOWERED and decision.tuning.token_budget == 80
    # Chasing the SLO itself (what a floor-only check amounts to here), it cuts on toward the floor.
    cut, _ = decide_tuning(obs, state, POLICY, now=100.0, feasibility=None)
    assert cut.kind == BUDGET_LOWERED and cut.tuning.token_budget < 80


def test_a_breach_the_smallest_budget_restores_stays_feasible():
    # Budget 512 at 1.5x the profile, p99 TPOT 314 ms > 264 ms: a few chunk-carrying iterations stall the
    # decodes; at budget 64 the same share costs far less. Feasible: the tuner must restore it by cutting.
    obs = observe(window(512, 314.0, 1.5, prefill_tps=300.0, utilisation=0.6, waiting=1))
    f = assess([obs], POLICY)
    assert TPOT not in f.infeasible and f.tpot_reachable_ms < 264.0 and f.tpot_target_ms == 264.0
    state = ReplicaTunerState(tuning=Tuning(512, 16))
    decision, _ = decide_tuning(obs, state, POLICY, now=100.0, feasibility=f)
    assert decision.kind == BUDGET_LOWERED


def test_a_quiet_window_is_feasible_and_aims_at_the_slo_itself():
    obs = observe(window(256, 60.0, 1.2, prefill_tps=90.0, decode_tps=45.0, utilisation=0.2, waiting=0))
    f = assess([obs], POLICY)
    assert f.feasible and f.tpot_target_ms == 264.0
