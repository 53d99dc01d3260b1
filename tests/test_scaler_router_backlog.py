"""The scaler with the router's queue: demand as it arrived, the backlog drained by every replica, the drain's
surplus shed once the backlog is gone, scale-in that follows the window's largest recommendation down."""
from __future__ import annotations

from dataclasses import replace

from stallfree.operator.control.policy import ScalingPolicy
from stallfree.operator.control.scaler import (HOLD, SCALED_DOWN, SCALED_UP, ReplicaLoad, RouterBacklog, ScalerState,
                                               decide_replicas)

POLICY = ScalingPolicy(min_replicas=1, max_replicas=10, scale_up_stabilization_s=30, scale_down_stabilization_s=300,
                       panic_ratio=1e9, drain_target_s=30)
CAP = 6000.0


def replica(name: str, dispatched: float, breaching: bool, waiting: int = 0) -> ReplicaLoad:
    return ReplicaLoad(name, known=True, ready=True, at_ceiling=True, breaching=breaching, slo_met=not breaching,
                       prompt_tokens_per_s=dispatched, capacity_tokens_per_s=CAP, num_waiting=waiting)


def test_demand_is_what_arrived_at_the_router_not_what_replicas_were_given():
    # One replica at capacity takes 6k tok/s; 18k arrive at the router (nothing queued there yet): sized from
    # the router's count, 4 replicas at 90%.
    backlog = RouterBacklog(queued_requests=0, queued_prompt_tokens=0.0, arrival_prompt_tokens_per_s=18000.0)
    state, t = ScalerState(), 0.0
    for _ in range(4):
        t += 10
        decision, state = decide_replicas([replica("r0", 6000.0, True)], 1, POLICY, state, t, None, backlog)
        if decision.changed:
            break
    assert decision.kind == SCALED_UP and decision.desired == 4  # ceil(18000 / (6000 x 0.9)) = 4
    without = ScalerState()
    for step in range(4):
        d, without = decide_replicas([replica("r0", 6000.0, True)], 1, POLICY, without, 10.0 * (step + 1))
    assert d.desired < decision.desired  # read off the replica alone, the demand looks like one replica's


def test_the_routers_backlog_is_sized_to_drain_within_the_target():
    queued = 30 * 6000.0  # 30 s of one replica's prefill waits at the router
    backlog = RouterBacklog(queued_requests=60, queued_prompt_tokens=queued, arrival_prompt_tokens_per_s=6000.0,
                            breaching=True)
    state, t, decision = ScalerState(), 0.0, None
    for _ in range(4):
        t += 10
        decision, state = decide_replicas([replica("r0", 6000.0, True)], 1, POLICY, state, t, None, backlog)
        if decision.changed:
            break
    # demand 6000 + drain 180000/30 = 12000 tok/s at 90% of 6000: 3 replicas; the demand alone needs 2.
    assert decision.desired == 3 and state.drain_surplus == 1


def test_the_drain_surplus_goes_once_the_backlog_is_drained_without_waiting_the_window():
    state = replace(ScalerState(), drain_surplus=2, last_scale_at=100.0, last_direction=1,
                    recommendations=((100.0, 5),))
    calm = [replica(f"r{i}", 2500.0, False) for i in range(5)]  # 12.5k tok/s: 3 replicas at 85%
    drained = RouterBacklog(0, 0.0, 12500.0, False)
    decision, state = decide_replicas(calm, 5, POLICY, state, 160.0, None, drained)
    assert decision.kind == SCALED_DOWN and decision.reason == "backlog_drained" and decision.desired == 3
    assert state.drain_surplus == 0
    # While requests still wait at the router, the surplus stays.
    waiting = replace(ScalerState(), drain_surplus=2, last_scale_at=100.0, last_direction=1,
                      recommendations=((100.0, 5),))
    held, _ = decide_replicas(calm, 5, POLICY, waiting, 160.0, None, RouterBacklog(3, 9000.0, 12500.0, False))
    assert held.kind == HOLD


def test_scale_in_follows_the_windows_largest_recommendation_step_by_step():
    state, t, counts, current = ScalerState(), 0.0, [], 6
    demand = [12000.0] * 20 + [6000.0] * 60  # 3 replicas' worth, then 2 (at 85%: ceil(12000/5100) = 3, then 2)
    for d in demand:
        t += 10
        loads = [replica(f"r{i}", d / current, False) for i in range(current)]
        decision, state = decide_replicas(loads, current, POLICY, state, t, None, RouterBacklog(0, 0.0, d, False))
        if decision.changed:
            assert decision.kind == SCALED_DOWN
            counts.append((t, decision.desired))
            current = decision.desired
    assert [n for _, n in counts] == [3, 2]
    # The second step follows the first as soon as the window's largest recommendation allows, not a whole
    # new window after it.
    assert counts[1][0] - counts[0][0] < 300


def test_long_prompts_are_sized_for_their_queue_wait_not_only_their_utilisation():
    # 0.6 prompts/s of 6,000 tokens: 60% of one replica, yet one replica's p99 wait is past a 2 s SLO.
    backlog = RouterBacklog(queued_requests=3, queued_prompt_tokens=18000.0, arrival_prompt_tokens_per_s=3600.0,
                            breaching=True, arrival_requests_per_s=0.6, prompt_cv2=0.04)
    state, t, decision = ScalerState(), 0.0, None
    for _ in range(4):
        t += 10
        decision, state = decide_replicas([replica("r0", 3600.0, True, waiting=3)], 1, POLICY, state, t, None,
                                          backlog, queue_wait_slo_s=2.0)
        if decision.changed:
            break
    assert decision.desired == 2 and state.drain_surplus == 0  # the second is the demand's, not a drain's
    # Once the backlog is drained it stays: the demand's count for that wait is 2.
    calm = [replica(f"r{i}", 1800.0, False) for i in range(2)]
    drained = replace(backlog, queued_requests=0, queued_prompt_tokens=0.0, breaching=False)
    for _ in range(40):
        t += 10
        decision, state = decide_replicas(calm, 2, POLICY, state, t, None, drained, queue_wait_slo_s=2.0)
        assert decision.desired == 2
    # Without the SLO (or the router's request count) the count is utilisation's: one replica's worth.
    decision, _ = decide_replicas(calm, 2, POLICY, ScalerState(), 1000.0, None, drained)
    assert decision.reason == "stabilizing" and "fits 1 replicas" in decision.message
