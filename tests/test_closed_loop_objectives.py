"""The objectives scenarios' judging (mixed-objectives, tenants) and their side-by-side streams; the scenarios
themselves run in `stallfree control --scenario mixed-objectives|tenants`."""
from __future__ import annotations

import asyncio

import pytest

from stallfree.contracts import Ceilings, Tuning
from stallfree.operator.api.spec import InferenceServiceStatus
from stallfree.operator.reconcile.control_handlers import status_fields
from stallfree.operator.control.policy import ControlPolicy, ObjectiveTargets, SLOTargets
from stallfree.simulator.closed_loop import ClusterSpec
from stallfree.simulator.closed_loop_scenarios import SCENARIOS
from stallfree.simulator.closed_loop_scenarios_objectives import (ObjectivePhase, StreamsDriver, judge_mixed,
                                                                 judge_tenants, router_objectives, spare_prefill_used,
                                                                 streams)
from stallfree.simulator.workload import Fixed


def _mixed(goodput=0.995, late=0, lost=0, refused=0) -> dict:
    return {"interactive": {"goodput": goodput},
            "batch": {"served_late": late, "lost": lost, "refused": refused}}


def test_mixed_objectives_goals_each_fail_on_their_own_miss():
    assert all(judge_mixed(_mixed(), 0.95).values())
    assert not judge_mixed(_mixed(goodput=0.98), 0.95)["interactive_goodput_at_least_99pct"]
    for miss in ({"late": 1}, {"lost": 1}, {"refused": 1}):
        assert not judge_mixed(_mixed(**miss), 0.95)["no_batch_request_waits_past_its_deadline_then_fails"]
    assert not judge_mixed(_mixed(), 0.89)["batch_uses_at_least_90pct_of_spare_prefill"]
    assert not judge_mixed(_mixed(), None)["batch_uses_at_least_90pct_of_spare_prefill"]


def test_spare_prefill_is_what_the_interactive_load_left():
    # 4 replicas x 100 s at 1000 tok/s = 400k; interactive took 240k: 160k spare, batch used 150k.
    assert spare_prefill_used(150_000, 240_000, 1000.0, 400.0) == pytest.approx(0.9375)
    assert spare_prefill_used(1, 400_000, 1000.0, 400.0) is None


def test_tenants_goal_compares_each_tenant_with_its_own_run_without_the_flood():
    goals = judge_tenants({"a": 1100.0, "b": 1300.0, "c": None}, {"a": 1000.0, "b": 1000.0, "c": 900.0})
    assert goals == {"tenant_a_p99_ttft_within_1.2x_of_no_flood": True,
                     "tenant_b_p99_ttft_within_1.2x_of_no_flood": False,
                     "tenant_c_p99_ttft_within_1.2x_of_no_flood": False,
                     "every_other_tenants_request_served": True}
    # A refused request has no TTFT: the p99 over the served alone would hide it.
    assert judge_tenants({"a": 1000.0}, {"a": 1000.0}, others_not_served=3) == {
        "tenant_a_p99_ttft_within_1.2x_of_no_flood": True, "every_other_tenants_request_served": False}


def test_the_scenarios_are_registered():
    assert {"mixed-objectives", "tenants"} <= set(SCENARIOS)


def test_streams_run_side_by_side_and_reach_the_router_with_their_labels():
    policy = ControlPolicy(slo=SLOTargets(3000, 100, 2000), interval_s=10, window_s=30,
                           objectives=(ObjectiveTargets("interactive", 0, 3000, 100, 2000, default=True),
                                       ObjectiveTargets("batch", -1, 30000, 100, 30000)))
    phases = [ObjectivePhase(0, 2.0, Fixed(256), Fixed(8), objective="interactive", tenant="a", stream="i"),
              ObjectivePhase(0, 1.0, Fixed(256), Fixed(8), objective="batch", tenant="b", stream="b"),
              ObjectivePhase(10, 0.0, Fixed(256), Fixed(8), objective="batch", tenant="b", stream="b")]
    assert set(streams(phases)) == {"i", "b"}
    assert router_objectives(policy).default.name == "interactive"
    cluster = ClusterSpec("llama-3-8b", "h100", ceilings=Ceilings(2048, 256), start_tuning=Tuning(512, 128))
    driver = StreamsDriver(cluster, policy, phases, replicas=1, seed=3)
    asyncio.run(driver.run(20.0))
    offered = driver.cluster.router.outcomes.offered
    assert {o.objective for o in offered} == {"interactive", "batch"}
    assert all(o.arrival_s < 10.0 for o in offered if o.objective == "batch")  # its stream stopped at 10 s
    assert any(o.arrival_s >= 10.0 for o in offered if o.objective == "interactive")  # the other one did not
    assert {o.tenant for o in offered} == {"a", "b"}
    fields = status_fields(driver.steps[-1])
    rows = {row["name"]: row for row in fields["control"]["objectives"]}
    assert set(rows) == {"interactive", "batch"} and rows["batch"]["sheddable"]
    assert {"p99TtftMs", "p99TpotMs", "p99QueueWaitMs", "goodput", "feasible", "shed"} <= set(rows["interactive"])
    assert rows["interactive"]["goodput"] is not None and fields["goodput"] == fields["control"]["goodput"]
    status = InferenceServiceStatus.model_validate(fields)  # what the CRD's status schema takes
    assert status.goodput == fields["goodput"]
