"""SLO feasibility from the profile: an impossible TPOT SLO is reported and held at the closest reachable
setting, a feasible one never raises it (the real control loop over sim-backed virtual replicas)."""
from __future__ import annotations

import pytest

from stallfree.contracts import Ceilings, Tuning
from stallfree.operator.control.feasibility import TPOT, assess
from stallfree.operator.control.policy import ControlPolicy, ScalingPolicy, SLOTargets
from stallfree.simulator.closed_loop import ClosedLoopDriver, ClusterSpec, LoadPhase
from stallfree.simulator.workload import parse_length

# Mistral-7B on an A100 (cost model): one decode alone takes about 8.5 ms.
CLUSTER = ClusterSpec("mistral-7b", "a100", ceilings=Ceilings(2048, 256), start_tuning=Tuning(512, 64),
                      max_model_len=8192)
CHAT = [LoadPhase(0, 4.0, parse_length("uniform:256:768"), parse_length("uniform:32:128"))]


def policy(tpot_ms: float) -> ControlPolicy:
    return ControlPolicy(slo=SLOTargets(ttft_p99_ms=3000, tpot_p99_ms=tpot_ms, queue_wait_p99_ms=2000),
                         scaling=ScalingPolicy(min_replicas=1, max_replicas=1), interval_s=10, window_s=10)


async def run(tpot_ms: float, steps: int = 12):
    driver = ClosedLoopDriver(CLUSTER, policy(tpot_ms), CHAT)
    results = [await driver.step() for _ in range(steps)]
    return driver, results


def feasible_condition(result):
    return next(c for c in result.conditions if c.type == "SLOFeasible")


async def test_an_impossible_tpot_slo_is_reported_and_the_budget_does_not_slide_to_its_floor():
    driver, results = await run(tpot_ms=5.0)
    last = results[-1]
    cond = feasible_condition(last)
    assert cond.status == "False" and cond.reason == "SLOInfeasible"
    assert "decode-only iteration" in cond.message and "5 ms" in cond.message
    assert TPOT in last.feasibility.infeasible and last.feasibility.tpot_floor_ms > 5.0
    events = [e for e in driver.actuator.events if e["reason"] == "SLOInfeasible"]
    assert len(events) == 1 and events[0]["warning"]
    assert "SLOFeasible=False" in last.feasible_line and last.to_status()["feasibility"]["infeasible"] == ["tpot"]
    budgets = [o.stats.tuning.token_budget for r in results for o in r.observations if o.stats is not None]
    # Held at the closest reachable TPOT from the start (the profile's smallest iteration): never cut step by
    # step toward the floor by TPOT breaches, never moved down after the start.
    assert all(later >= earlier for earlier, later in zip(budgets[1:], budgets[2:]))
    assert not any(d.kind == "budget_lowered" for r in results for d in r.tuning)


async def test_a_feasible_tpot_slo_never_raises_the_condition():
    driver, results = await run(tpot_ms=40.0)
    assert all(feasible_condition(r).status == "True" for r in results)
    assert not any(e["reason"] in ("SLOInfeasible", "SLOTradeoff") for e in driver.actuator.events)
    assert results[-1].feasibility.tpot_target_ms == 40.0


async def test_demand_beyond_max_replicas_names_the_slo_held_by_priority():
    heavy = [LoadPhase(0, 12.0, parse_length("uniform:2048:4096"), parse_length("uniform:16:48"))]
    driver = ClosedLoopDriver(CLUSTER, policy(40.0), heavy)
    results = [await driver.step() for _ in range(6)]
    # The demand as it arrived at the router (its queue holds what the replica did not take), as the loop passes it.
    f = assess(results[-1].observations, policy(40.0), None, results[-1].queue.arrival_prompt_tokens_per_s)
    assert f.infeasible == ("queueWait", "ttft") and f.held == "tpot"
    assert "holding TPOT first (priority TPOT > queue wait > TTFT)" in f.message
    assert f.replicas_needed > 1 and f.capacity_tokens_per_s < f.demand_tokens_per_s
    cond = feasible_condition(results[-1])
    assert cond.status == "False" and "maxReplicas is 1" in cond.message


@pytest.mark.parametrize("priority", [("queueWait", "tpot", "ttft")])
async def test_the_spec_priority_decides_which_slo_is_held(priority):
    heavy = [LoadPhase(0, 12.0, parse_length("uniform:2048:4096"), parse_length("uniform:16:48"))]
    from dataclasses import replace
    p = replace(policy(40.0), slo_priority=priority)
    driver = ClosedLoopDriver(CLUSTER, p, heavy)
    results = [await driver.step() for _ in range(4)]
    f = assess(results[-1].observations, p, None, results[-1].queue.arrival_prompt_tokens_per_s)
    assert f.held == "tpot" and "priority queue wait > TPOT > TTFT" in f.message
