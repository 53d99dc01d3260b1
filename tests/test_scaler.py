"""The scaler, pure: capacity exhaustion sized from demand, cooldowns, stabilized scale-in, unknown replicas."""
from __future__ import annotations

import json

import pytest
from dataclasses import replace

from stallfree.operator.control.policy import ScalingPolicy
from stallfree.operator.control.scaler import HOLD, SCALED_DOWN, SCALED_UP, ReplicaLoad, ScalerState, decide_replicas

# The windows and sizing from demand in isolation: no panic window, queued work ignored (tested on their own below).
POLICY = ScalingPolicy(min_replicas=1, max_replicas=10, scale_up_stabilization_s=30, scale_down_stabilization_s=300,
                       panic_ratio=1e9, drain_target_s=1e9)
BACKLOG_POLICY = ScalingPolicy(min_replicas=1, max_replicas=10, scale_up_stabilization_s=30,
                               scale_down_stabilization_s=300, drain_target_s=30)
CAP = 6000.0  # prefill tokens/s per replica


def loaded(name: str, demand: float, at_ceiling: bool = True, breaching: bool = True, waiting: int = 50) -> ReplicaLoad:
    return ReplicaLoad(name, known=True, ready=True, at_ceiling=at_ceiling, breaching=breaching,
                       slo_met=not breaching, prompt_tokens_per_s=demand, capacity_tokens_per_s=CAP,
                       num_waiting=waiting)


def quiet(name: str, demand: float) -> ReplicaLoad:
    return loaded(name, demand, at_ceiling=False, breaching=False, waiting=0)


def unknown(name: str, ready: bool = True) -> ReplicaLoad:
    return ReplicaLoad(name, known=False, ready=ready, unknown_reason="stats scrape failed: timed out" if ready
                       else "not ready")


def run(steps, policy=POLICY, state=ScalerState(), current=1, start=0.0, interval=10.0):
    """Feed `steps` (a list of load lists, or a callable of the current count) one interval apart."""
    decisions = []
    t = start
    for loads in steps:
        t += interval
        loads = loads(current) if callable(loads) else loads
        decision, state = decide_replicas(loads, current, policy, state, t)
        decisions.append((t, decision))
        current = decision.desired
    return decisions, state, current


def test_exhaustion_must_last_a_window_then_sizes_from_demand_not_plus_one():
    demand = 3.4 * CAP
    decisions, _, current = run([[loaded("r0", demand)]] * 4)
    kinds = [d.kind for _, d in decisions]
    assert kinds[:3] == [HOLD, HOLD, HOLD] and decisions[0][1].reason == "capacity_exhausted_waiting"
    assert kinds[3] == SCALED_UP and current == 4  # ceil(3.4 / 0.9), not 2
    assert decisions[3][1].capacity_exhausted is True
    assert "demand" in decisions[3][1].message


def test_no_exhaustion_while_a_replica_can_still_raise_its_budget():
    loads = [loaded("r0", 2 * CAP), loaded("r1", 2 * CAP, at_ceiling=False)]
    decisions, _, current = run([loads] * 10, current=2)
    assert current == 2 and all(d.capacity_exhausted is False for _, d in decisions)


def test_cooldown_after_a_scale_up_and_no_double_count_of_starting_replicas():
    demand = 3.4 * CAP
    decisions, state, current = run([[loaded("r0", demand)]] * 4)
    assert current == 4
    # The new ones are starting (not ready): r0 still reports the whole demand, and stays exhausted.
    starting = [loaded("r0", demand), unknown("r1", False), unknown("r2", False), unknown("r3", False)]
    decisions, state, current = run([starting] * 6, state=state, current=4, start=40.0)
    assert current == 4
    assert {d.reason for _, d in decisions} <= {"capacity_exhausted_waiting", "replicas_starting"}
    # A restarted operator that lost every memory still does not add more for the same demand.
    decisions, _, current = run([starting] * 6, state=ScalerState(), current=4, start=100.0)
    assert current == 4 and decisions[-1][1].reason == "replicas_starting"


def test_backlog_draining_does_not_add_replicas_but_growing_queues_do():
    state = ScalerState(last_scale_at=0.0, last_direction=1)
    draining = [[loaded(f"r{i}", 0.75 * CAP, waiting=100 - 10 * k) for i in range(4)] for k in range(8)]
    decisions, _, current = run(draining, state=state, current=4, start=40.0)
    assert current == 4 and decisions[-1][1].reason == "backlog_draining"
    growing = [[loaded(f"r{i}", 0.75 * CAP, waiting=10 + 10 * k) for i in range(4)] for k in range(5)]
    decisions, _, current = run(growing, state=state, current=4, start=40.0)
    assert current == 5  # the estimate says 4 suffice, the queues say otherwise: one more
    assert [d.kind for _, d in decisions].count(SCALED_UP) == 1


def test_unreadable_serving_replica_counts_as_itself_and_blocks_scale_in():
    # r1 serves but cannot be read: its share is unknown, so it is kept and never counted as spare.
    decisions, _, current = run([[loaded("r0", 2.5 * CAP), unknown("r1")]] * 4, current=2)
    assert current == 1 + 3  # r1 itself + ceil(2.5 / 0.9) for what r0 sees
    assert "1 unknown" in decisions[-1][1].message
    # Light load for far longer than the stabilization window: never a scale-in.
    decisions, _, current = run([[quiet("r0", 0.1 * CAP), unknown("r1")]] * 60, current=2)
    assert current == 2 and all(d.reason == "scale_in_blocked" for _, d in decisions)
    assert "r1 unknown" in decisions[-1][1].message


def test_no_known_replica_no_decision():
    decision, state = decide_replicas([unknown("r0"), unknown("r1", False)], 2, POLICY, ScalerState(), 10.0)
    assert decision.kind == HOLD and decision.reason == "no_known_replicas" and decision.capacity_exhausted is None
    assert state.exhausted_since is None


def test_scale_in_waits_out_the_window_and_takes_its_largest_recommendation():
    steps = [[quiet(f"r{i}", 0.3 * CAP) for i in range(4)]] * 29  # 1.2 replicas' demand: fits 2 at 85%
    decisions, state, current = run(steps, current=4)
    assert current == 4 and decisions[-1][1].reason == "stabilizing"
    decisions, state, current = run([[quiet(f"r{i}", 0.3 * CAP) for i in range(4)]] * 2, state=state, current=4,
                                    start=290.0)
    assert current == 2 and decisions[-1][1].kind == SCALED_DOWN and decisions[-1][0] >= 300
    # A busier spell inside the window holds the count at what that spell needed.
    busy_then_quiet = [[quiet(f"r{i}", 0.6 * CAP) for i in range(4)]] * 5 + \
        [[quiet(f"r{i}", 0.1 * CAP) for i in range(4)]] * 26
    decisions, _, current = run(busy_then_quiet, current=4)
    assert current == 3  # 2.4 replicas' demand at 85% needed 3 within the last 300 s


def test_scale_in_never_while_an_slo_is_missed():
    steps = [[loaded(f"r{i}", 0.1 * CAP, at_ceiling=False, breaching=True) for i in range(3)]] * 50
    _, _, current = run(steps, current=3)
    assert current == 3


def test_a_few_unknown_steps_neither_allow_nor_block():
    fits = [quiet("r0", 0.2 * CAP), quiet("r1", 0.2 * CAP)]
    gappy = [fits if k % 3 else [quiet("r0", 0.2 * CAP), unknown("r1")] for k in range(40)]
    decisions, _, current = run(gappy, current=2)
    assert current == 1
    t, down = next((t, d) for t, d in decisions if d.kind == SCALED_DOWN)
    assert t >= 300 and all(o.known for o in fits)


def test_bounds_hold():
    policy = ScalingPolicy(min_replicas=2, max_replicas=3, scale_up_stabilization_s=0, scale_down_stabilization_s=0)
    decision, _ = decide_replicas([loaded("r0", 10 * CAP)], 1, policy, ScalerState(), 10.0)
    assert decision.desired == 2 and decision.reason == "replica_bounds"
    decision, _ = decide_replicas([loaded(f"r{i}", 10 * CAP) for i in range(3)], 3, policy, ScalerState(), 10.0)
    assert decision.desired == 3 and decision.reason == "at_max_replicas" and decision.capacity_exhausted
    decision, _ = decide_replicas([quiet(f"r{i}", 0.0) for i in range(3)], 3, policy, ScalerState(), 10.0)
    assert decision.desired == 2


def test_no_flapping_under_noisy_load_near_a_boundary():
    import random

    rng = random.Random(7)
    steps = [lambda n: [quiet(f"r{i}", rng.uniform(1.1, 1.5) * CAP / n) for i in range(n)]] * 180
    decisions, _, _ = run(steps, current=3)
    changes = [d for _, d in decisions if d.changed]
    assert len(changes) <= 1 and all(d.kind == SCALED_DOWN for d in changes)


def test_state_round_trips_through_json():
    _, state, _ = run([[loaded("r0", 3 * CAP)]] * 5)
    again = ScalerState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state


def test_backlog_aware_sizing_panics_counts_busy_replicas_and_measured_start_up():
    # Demand 3.4x one replica's capacity: beyond the panic ratio, so no stabilization wait.
    r0 = ReplicaLoad("r0", known=True, ready=True, at_ceiling=True, breaching=True, slo_met=False,
                     prompt_tokens_per_s=3.4 * CAP, capacity_tokens_per_s=CAP, num_waiting=200,
                     queued_prompt_tokens=60 * CAP)  # a minute of r0's prefill already queued
    decision, state = decide_replicas([r0], 1, BACKLOG_POLICY, ScalerState(), 10.0)
    assert decision.kind == SCALED_UP
    # r0 drains its own queue (60 s + the 2.4 x CAP it cannot take for the 30 s start-up > 30 s target): busy.
    assert decision.busy_replicas == 1 and decision.desired == 1 + 4  # busy + ceil(3.4 / 0.9)
    # A queue small enough for spare capacity to drain within the target adds to the demand instead.
    small = replace(r0, prompt_tokens_per_s=1.5 * CAP, queued_prompt_tokens=3 * CAP)
    decision, _ = decide_replicas([small], 1, replace(BACKLOG_POLICY, panic_ratio=1.2), ScalerState(), 10.0)
    # backlog 3 CAP.s + 0.5 CAP x 30 s = 18 CAP.s over 30 s = 0.6 CAP: ceil((1.5 + 0.6) / 0.9) = 3
    assert decision.busy_replicas == 0 and decision.desired == 3
    # Start-up is measured from replicas going from not ready to ready.
    state = ScalerState()
    for t, ready in ((0.0, False), (10.0, False), (20.0, False), (30.0, True)):
        _, state = decide_replicas([quiet("r0", CAP), ReplicaLoad("r1", known=ready, ready=ready,
                                                                   unknown_reason=None if ready else "not ready")],
                                   2, BACKLOG_POLICY, state, t)
    assert state.startup_s == (30.0,) and state.expected_startup_s(99.0) == 30.0
    assert ScalerState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_a_step_up_panics_from_the_queue_growth_of_one_interval():
    # The 30 s window still averages mostly light load (1.2 CAP), but the queue grew by 30 s of prefill in 10 s.
    before = ReplicaLoad("r0", known=True, ready=True, at_ceiling=True, breaching=False, prompt_tokens_per_s=0.8 * CAP,
                         prefill_tokens_per_s=0.8 * CAP, capacity_tokens_per_s=CAP, num_waiting=1,
                         queued_prompt_tokens=0.0)
    after = replace(before, breaching=True, slo_met=False, prompt_tokens_per_s=1.2 * CAP, prefill_tokens_per_s=CAP,
                    num_waiting=30, queued_prompt_tokens=30 * CAP)
    _, state = decide_replicas([before], 1, BACKLOG_POLICY, ScalerState(), 10.0)
    decision, _ = decide_replicas([after], 1, BACKLOG_POLICY, state, 20.0)
    # Arriving over the last interval: CAP prefilled + 30 CAP queued in 10 s = 4 CAP >= panic 2 CAP: no wait.
    # Less one Poisson standard deviation of the interval's count (40 requests of CAP tokens: sqrt(40) CAP over 10 s).
    assert decision.kind == SCALED_UP and decision.short_demand_tokens_per_s == pytest.approx((4 - 40 ** 0.5 / 10) * CAP)
    assert decision.demand_tokens_per_s == 1.2 * CAP  # the window's demand is still reported as measured
    assert decision.desired >= 1 + 4  # r0 busy with its 30 s queue, plus ceil(3.37 / 0.9) for the arrivals
    # Without the previous step (no short window), the window's 1.2 CAP waits out the stabilization window.
    first, _ = decide_replicas([after], 1, BACKLOG_POLICY, ScalerState(), 20.0)
    assert first.kind == HOLD and first.reason == "capacity_exhausted_waiting"


def test_capacity_is_feasibilitys_until_replicas_reach_their_ceiling():
    # Two replicas still raising a small budget measure 0.3 CAP each; at the TPOT-allowed budget one does CAP.
    slow = [replace(quiet(f"r{i}", 0.3 * CAP), capacity_tokens_per_s=0.3 * CAP) for i in range(2)]
    decision, _ = decide_replicas(slow, 2, POLICY, ScalerState(), 10.0, service_capacity=CAP)
    assert decision.capacity_per_replica_tokens_per_s == CAP and decision.reason == "stabilizing"  # 0.6 CAP fits in 1
    decision, _ = decide_replicas(slow, 2, POLICY, ScalerState(), 10.0)
    assert decision.capacity_per_replica_tokens_per_s == 0.3 * CAP and decision.reason == "load_fits"
    # Replicas at their ceiling show what a replica delivers: their measurement wins over feasibility's.
    full = [replace(loaded(f"r{i}", 2 * CAP), capacity_tokens_per_s=0.8 * CAP) for i in range(2)]
    decision, _ = decide_replicas(full, 2, POLICY, ScalerState(), 10.0, service_capacity=CAP)
    assert decision.capacity_per_replica_tokens_per_s == 0.8 * CAP


def test_a_replica_draining_its_own_backlog_does_not_hold_the_burst_count():
    # After a burst: r0 drains 100 s of its own queue (missing its SLOs), three new replicas carry 0.5 CAP.
    def loads(step: int, count: int):
        waiting = max(0, 100 - 10 * step)
        r0 = ReplicaLoad("r0", known=True, ready=True, breaching=waiting > 0 or step < 13, slo_met=step >= 13,
                         prompt_tokens_per_s=0.0, prefill_tokens_per_s=CAP, capacity_tokens_per_s=CAP,
                         num_waiting=waiting, queued_prompt_tokens=waiting * CAP)
        return [r0] + [quiet(f"r{i}", 0.5 * CAP / (count - 1)) for i in range(1, count)]

    steps = [(lambda k: (lambda count: loads(k, count)))(k) for k in range(40)]
    scaled_up = ScalerState(last_scale_at=0.0, last_direction=1, last_step_at=0.0, last_queues=(("r0", 110, 110 * CAP),))
    decisions, state, current = run(steps, BACKLOG_POLICY, scaled_up, current=4)
    downs = [(t, d) for t, d in decisions if d.kind == SCALED_DOWN]
    # A whole window after the scale-up, straight to one replica for the demand plus r0 (not held at 4 by r0).
    assert downs and downs[0][0] == 310.0 and downs[0][1].desired == 2 and current == 2
    assert all(d.kind != SCALED_UP for _, d in decisions)  # no flapping back up
    assert ScalerState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_a_miss_without_a_backlog_still_blocks_scale_in():
    # The same quiet service, but r0 misses its SLO with an empty queue: no scale-in on that evidence.
    r0 = ReplicaLoad("r0", known=True, ready=True, breaching=True, slo_met=False, prompt_tokens_per_s=0.1 * CAP,
                     prefill_tokens_per_s=0.1 * CAP, capacity_tokens_per_s=CAP, num_waiting=0)
    decisions, _, current = run([lambda count: [r0] + [quiet(f"r{i}", 0.1 * CAP) for i in range(1, count)]] * 40,
                                BACKLOG_POLICY, current=4)
    assert current == 4 and all(d.reason == "scale_in_blocked" for _, d in decisions)


def test_the_loop_tells_the_scaler_when_tuning_has_nothing_left():
    from control_helpers import observation, stats
    from stallfree.operator.control.feasibility import Feasibility
    from stallfree.operator.control.loop import _replica_load
    from stallfree.operator.control.policy import ControlPolicy
    from stallfree.operator.control.tuner import TuningDecision

    policy = ControlPolicy()
    hold = TuningDecision("r0", None, HOLD, "within_slo", "", False)
    # Queue wait presses while neither the budget (half used) nor the sequence cap binds: the tuner holds with
    # "not_budget_bound", and the scaler must read that as no tuning left (else a ramp never scales).
    pressed = observation(window=stats(queue=900.0, utilisation=0.5))
    assert _replica_load(pressed, replace(hold, reason="not_budget_bound"), policy).at_ceiling
    assert not _replica_load(pressed, hold, policy).at_ceiling
    # A queue already building on a budget at the largest the TPOT target allows: at its ceiling, whatever the
    # window's mean utilisation still says; below that budget, or with no queue, not.
    at_budget = Feasibility(tpot_floor_ms=5.0, tpot_budget=512)
    queued = observation(window=stats(waiting=30, utilisation=0.4, budget=512))
    assert _replica_load(queued, hold, policy, at_budget).at_ceiling
    assert not _replica_load(queued, hold, policy, replace(at_budget, tpot_budget=768)).at_ceiling
    assert not _replica_load(observation(window=stats(waiting=0, budget=512)), hold, policy, at_budget).at_ceiling
