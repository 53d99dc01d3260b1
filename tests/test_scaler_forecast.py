"""The scaler ahead of predictable load (a trusted forecast) and its scale-in choice (which replica goes)."""
from __future__ import annotations

import asyncio

from stallfree.contracts import Ceilings, Tuning
from stallfree.operator.control.policy import ScalingPolicy
from stallfree.operator.control.scaler import (HOLD, SCALED_UP, ReplicaLoad, RouterBacklog, ScalerState,
                                               decide_replicas, removal_order)
from stallfree.simulator.closed_loop import ClusterSpec, VirtualActuator, VirtualCluster

POLICY = ScalingPolicy(min_replicas=1, max_replicas=10, scale_up_stabilization_s=30, scale_down_stabilization_s=300)
CAP = 6000.0


def quiet(name: str, demand: float, capacity: float = CAP, ready: bool = True) -> ReplicaLoad:
    """Within every SLO, nothing queued, the tuner not at its ceiling: the reactive scaler sees no reason to act."""
    return ReplicaLoad(name, known=True, ready=ready, at_ceiling=False, breaching=False, slo_met=True,
                       prompt_tokens_per_s=demand, capacity_tokens_per_s=capacity)


def test_a_trusted_forecast_scales_before_the_load_arrives_and_sizes_for_it():
    loads = [quiet("r0", 0.5 * CAP), quiet("r1", 0.5 * CAP)]
    reactive, _ = decide_replicas(loads, 2, POLICY, ScalerState(), 10.0)
    assert reactive.kind == HOLD  # today: nothing breaches, nothing is at its ceiling
    state, kinds = ScalerState(), []
    for t in (10.0, 20.0, 30.0, 40.0):  # the rise must hold for the stabilization window, as exhaustion does
        ahead, state = decide_replicas(loads, 2, POLICY, state, t, forecast_tokens_per_s=3.4 * CAP)
        kinds.append(ahead.kind)
    assert kinds == [HOLD, HOLD, HOLD, SCALED_UP] and ahead.desired == 4  # ceil((1 + 2.4) / 0.9)
    assert ahead.reason == "forecast_ahead" and "forecast" in ahead.message


def test_no_forecast_is_todays_reactive_decision():
    loads = [quiet("r0", 0.2 * CAP), quiet("r1", 0.2 * CAP)]
    state_a = state_b = ScalerState()
    for t in range(10, 400, 10):
        a, state_a = decide_replicas(loads, 2, POLICY, state_a, float(t))
        b, state_b = decide_replicas(loads, 2, POLICY, state_b, float(t), forecast_tokens_per_s=None)
        assert a == b
    assert a.desired == 1  # the load fits one replica once the scale-down window passed


def test_scale_in_keeps_what_the_forecast_needs():
    loads = [quiet("r0", 0.2 * CAP), quiet("r1", 0.2 * CAP), quiet("r2", 0.2 * CAP)]
    state, decision = ScalerState(), None
    for t in range(10, 400, 10):
        decision, state = decide_replicas(loads, 3, POLICY, state, float(t), forecast_tokens_per_s=2.0 * CAP)
    assert decision.desired == 3  # 2.0 x CAP at 85% needs 3, though the load now fits 1


def test_a_forecast_barely_above_the_measured_demand_does_not_scale_on_its_own():
    loads = [quiet("r0", 0.89 * CAP), quiet("r1", 0.89 * CAP)]  # just under 90% of two replicas
    state = ScalerState()
    for t in range(10, 100, 10):  # 4% above: beyond 90% of two replicas, but within MIN_FORECAST_RISE
        decision, state = decide_replicas(loads, 2, POLICY, state, float(t), forecast_tokens_per_s=1.04 * 1.78 * CAP)
        assert decision.kind == HOLD


def test_a_forecast_scales_for_the_queue_wait_tail_as_the_count_is_sized():
    # 3000-token prompts at 6000 tok/s: 2 requests/s a replica. A forecast of 1.7 replicas' demand fits two at 90%
    # utilisation, but their queue-wait tail needs a third (queueing.py): the count would be sized 3 once exhausted.
    loads = [quiet("r0", 0.5 * CAP), quiet("r1", 0.5 * CAP)]
    backlog = RouterBacklog(arrival_prompt_tokens_per_s=CAP, arrival_requests_per_s=2.0, prompt_cv2=0.04)

    def run(forecast):
        state, kinds = ScalerState(), []
        for t in (10.0, 20.0, 30.0, 40.0):
            decision, state = decide_replicas(loads, 2, POLICY, state, t, backlog=backlog, queue_wait_slo_s=2.0,
                                              forecast_tokens_per_s=forecast)
            kinds.append(decision.kind)
        return kinds, decision
    kinds, decision = run(1.7 * CAP)
    assert kinds == [HOLD, HOLD, HOLD, SCALED_UP] and decision.desired == 3 and decision.reason == "forecast_ahead"
    assert run(None)[0] == [HOLD] * 4  # reactive: nothing breaches, nothing is at its ceiling
    assert run(1.4 * CAP)[0] == [HOLD] * 4  # two replicas carry that forecast, tail included


def test_scale_in_removes_the_slowest_replica_first():
    loads = [quiet("r0", 1000, capacity=26000.0), quiet("r1", 1000, capacity=12000.0),
             quiet("r2", 1000, capacity=26000.0), quiet("r3", 1000, capacity=12000.0),
             ReplicaLoad("r4", known=False, ready=False, unknown_reason="not ready"),
             ReplicaLoad("r5", known=False, ready=True, unknown_reason="stats scrape failed")]
    # Starting first (it carries nothing), then the a100s (newest first), the h100s, and the unreadable last.
    assert removal_order(loads) == ("r4", "r3", "r1", "r2", "r0", "r5")
    # One GPU model: measured capacities differ by noise, the newest goes first as before.
    same = [quiet("r0", 1000, capacity=12100.0), quiet("r1", 1000, capacity=11900.0), quiet("r2", 1000, capacity=12000.0)]
    assert removal_order(same) == ("r2", "r1", "r0")


def test_the_virtual_cluster_removes_the_replicas_the_scaler_chose():
    cluster = VirtualCluster(ClusterSpec("mistral-7b", "a100", ceilings=Ceilings(2048, 256),
                                         start_tuning=Tuning(512, 128), hardware_mix=("a100", "h100")), 10.0, 2)
    actuator = VirtualActuator(cluster)
    loads = [quiet("r0", 1000, capacity=12000.0), quiet("r1", 1000, capacity=26000.0)]

    async def scale_in() -> None:
        await actuator.prefer_removal(removal_order(loads))
        await actuator.set_replicas(1)
    asyncio.run(scale_in())
    assert cluster.slots["r0"].draining and not cluster.slots["r1"].draining  # the h100 stays (newest-first would not)
