"""The scaler sizes for the protected (non-sheddable) objectives; a sheddable flood adds replicas only up to its
share of maxReplicas' capacity, and its long waits in the router's queue are not the service's breach."""
from __future__ import annotations

import pytest

from stallfree.operator.control.objective_demand import (protected_breaching, sized_for_scaler, sized_loads,
                                                         sized_queue, split_demand)
from stallfree.operator.control.observe import ObjectiveWindow, QueueObservation
from stallfree.operator.control.policy import ObjectiveTargets
from stallfree.operator.control.scaler import ReplicaLoad, decide_replicas, RouterBacklog, ScalerState
from stallfree.operator.control.policy import ScalingPolicy

TARGETS = (ObjectiveTargets("interactive", 0, 3000.0, 100.0, 2000.0, default=True),
           ObjectiveTargets("batch", -1, 30000.0, 100.0, 30000.0))


def _queue(interactive: float, batch: float, batch_depth: int = 200, batch_wait_ms: float = 25000.0,
           interactive_ttft: float | None = 1500.0) -> QueueObservation:
    windows = (ObjectiveWindow("interactive", 0, arrival_prompt_tokens_per_s=interactive,
                               recent_prompt_tokens=interactive * 10,
                               recent_requests=30, arrival_requests_per_s=3.0, depth=1, queued_prompt_tokens=3000.0,
                               oldest_wait_ms=100.0, ttft_p99_ms=interactive_ttft, queue_wait_p99_ms=500.0),
               ObjectiveWindow("batch", -1, arrival_prompt_tokens_per_s=batch, recent_prompt_tokens=batch * 10,
                               recent_requests=100, arrival_requests_per_s=10.0, depth=batch_depth,
                               queued_prompt_tokens=batch_depth * 3000.0, oldest_wait_ms=batch_wait_ms,
                               ttft_p99_ms=28000.0, queue_wait_p99_ms=27000.0))
    return QueueObservation(depth=1 + batch_depth, queued_prompt_tokens=3000.0 + batch_depth * 3000.0,
                            oldest_wait_ms=batch_wait_ms, arrival_prompt_tokens_per_s=interactive + batch,
                            recent_prompt_tokens=(interactive + batch) * 10, recent_requests=130, recent_s=10.0,
                            arrival_requests_per_s=13.0, objectives=windows)


def test_no_split_without_a_sheddable_objective_or_per_objective_arrivals():
    only = QueueObservation(0, 0.0, 0.0, 1000.0, objectives=(ObjectiveWindow("a", 0, arrival_prompt_tokens_per_s=1.0),))
    assert split_demand(only, 0.25, 4, 4000.0) is None
    unknown = QueueObservation(0, 0.0, 0.0, 1000.0,
                               objectives=(ObjectiveWindow("a", 0, arrival_prompt_tokens_per_s=1.0),
                                           ObjectiveWindow("b", -1)))
    assert split_demand(unknown, 0.25, 4, 4000.0) is None  # an older router: depth and shed counts only
    assert split_demand(None, 0.25, 4, 4000.0) is None


def test_the_sheddable_demand_counts_only_up_to_its_share_of_max_replicas():
    split = split_demand(_queue(10000.0, 50000.0), 0.25, 4, 4000.0)
    assert split.sheddable_allowed_tokens_per_s == pytest.approx(4000.0)  # a quarter of 4 replicas' capacity
    assert split.sized_tokens_per_s == pytest.approx(14000.0)
    assert split.fraction == pytest.approx(14000.0 / 60000.0)
    small = split_demand(_queue(10000.0, 1000.0), 0.25, 4, 4000.0)
    assert small.sized_tokens_per_s == pytest.approx(11000.0)  # within its share: counted whole
    assert split_demand(_queue(10000.0, 50000.0), 0.25, 4, None).sized_tokens_per_s == 10000.0  # capacity unknown


def test_the_sized_queue_holds_the_protected_work_and_their_oldest_wait():
    queue = _queue(10000.0, 50000.0)
    sized = sized_queue(queue, split_demand(queue, 0.25, 4, 4000.0))
    assert sized.depth == 1 and sized.queued_prompt_tokens == 3000.0 and sized.oldest_wait_ms == 100.0
    assert sized.arrival_prompt_tokens_per_s == pytest.approx(14000.0)
    assert sized.recent_prompt_tokens == pytest.approx(100000.0 + 0.08 * 500000.0)


def test_protected_breach_reads_the_protected_windows_alone():
    assert protected_breaching(_queue(1.0, 1.0).objectives, TARGETS) is False  # batch waits 28 s: its own business
    assert protected_breaching(_queue(1.0, 1.0, interactive_ttft=3500.0).objectives, TARGETS) is True
    assert protected_breaching((ObjectiveWindow("interactive", 0),), TARGETS) is None


def _loads(n: int, rate: float) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", True, True, at_ceiling=True, breaching=True, slo_met=False, prompt_tokens_per_s=rate,
                        num_waiting=4, capacity_tokens_per_s=4000.0, queued_prompt_tokens=12000.0,
                        prefill_tokens_per_s=rate) for i in range(n)]


def test_replica_figures_count_at_the_sized_share_and_the_protected_verdict():
    queue = _queue(10000.0, 50000.0)
    split = split_demand(queue, 0.25, 4, 4000.0)
    loads = sized_loads(_loads(3, 4000.0), split, False, {"r0": True, "r1": False})
    assert loads[0].prompt_tokens_per_s == pytest.approx(4000.0 * split.fraction)
    assert loads[0].num_waiting == 0 and not loads[0].breaching and loads[0].slo_met
    assert not loads[1].slo_met  # its own TPOT misses


def test_a_batch_flood_on_full_replicas_does_not_scale_past_the_protected_need():
    """Three replicas full of batch work beside interactive demand that fits them: the plain scaler scales out (the
    replicas look saturated and breaching); sized per objective it holds."""
    policy = ScalingPolicy(min_replicas=1, max_replicas=8, scale_up_stabilization_s=0)
    queue = _queue(7000.0, 50000.0)
    plain, _ = decide_replicas(_loads(3, 4000.0), 3, policy, ScalerState(), 100.0, 4000.0,
                               RouterBacklog(201, 603000.0, 57000.0, True, 57000.0, 13.0, prompt_cv2=0.05), 2.0, 3.0)
    assert plain.desired > 3
    loads, sized = sized_for_scaler(queue, _loads(3, 4000.0), {"r0": 60.0, "r1": 60.0, "r2": 60.0}, TARGETS, 100.0,
                                    0.25, 8, 4000.0)
    backlog = RouterBacklog(sized.depth, sized.queued_prompt_tokens, sized.arrival_prompt_tokens_per_s, False,
                            sized.arrival_prompt_tokens_per_s, sized.arrival_requests_per_s, prompt_cv2=0.05)
    held, _ = decide_replicas(loads, 3, policy, ScalerState(), 100.0, 4000.0, backlog, 2.0, 3.0)
    # 7000 protected + a quarter of 8 replicas' capacity (8000) = 15000 tok/s: at most 5 replicas, not 8.
    assert held.desired <= 5


def test_the_policy_reads_the_objectives_and_the_sheddable_share_off_the_spec():
    import pydantic

    from stallfree.operator.api.spec import parse_spec
    from stallfree.operator.control.policy import ControlPolicy

    spec = parse_spec({"model": {"name": "m"}, "scaling": {"maxReplicas": 6, "sheddableScaleOutShare": 0.5},
                       "objectives": [{"name": "chat", "priority": 10}, {"name": "batch", "priority": -1,
                                                                          "ttftP99Ms": 60000}]})
    policy = ControlPolicy.from_spec(spec)
    assert policy.scaling.sheddable_scale_out_share == 0.5
    by_name = {o.name: o for o in policy.objectives}
    assert by_name["chat"].default and not by_name["chat"].sheddable
    assert by_name["batch"].sheddable and by_name["batch"].ttft_p99_ms == 60000
    assert by_name["batch"].tpot_p99_ms == spec.slos.tpot_p99_ms  # defaults to spec.slos
    assert ControlPolicy.from_spec(parse_spec({"model": {"name": "m"}})).scaling.sheddable_scale_out_share == 0.25
    with pytest.raises(pydantic.ValidationError):
        parse_spec({"model": {"name": "m"}, "scaling": {"sheddableScaleOutShare": 1.5}})
