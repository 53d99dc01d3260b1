"""Status conditions: merging keeps transition times, and the Deployment's state reads out truthfully."""
from __future__ import annotations

from typing import Any

from stallfree.operator.api import conditions as cond


def deployment(replicas: int, ready: int, updated: int, total: int | None = None, generation: int = 2,
               observed: int = 2, extra: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": replicas if total is None else total,
                       "readyReplicas": ready, "updatedReplicas": updated, "conditions": extra or []}}


def by_type(conditions: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in conditions}


def test_merge_keeps_other_writers_types_and_transition_times() -> None:
    current = cond.merge([], [cond.condition("SLOMet", "True", "WithinSLO"),
                              cond.condition("Ready", "False", "NoReplicaReady")], now="t0")
    merged = cond.merge(current, [cond.condition("Ready", "False", "NoReplicaReady", "0/2 ready")], now="t1")
    assert cond.find(merged, "SLOMet")["lastTransitionTime"] == "t0"  # untouched
    assert cond.find(merged, "Ready")["lastTransitionTime"] == "t0"  # same status: no transition
    merged = cond.merge(merged, [cond.condition("Ready", "True", "ReplicasReady")], now="t2")
    assert cond.find(merged, "Ready")["lastTransitionTime"] == "t2"
    assert not cond.changed(merged, [cond.condition("Ready", "True", "ReplicasReady")])
    assert cond.changed(merged, [cond.condition("Ready", "True", "ReplicasReady", "2/2 ready")])


def test_no_deployment_yet() -> None:
    assert by_type(cond.rollout_conditions(None, 2)) == {
        "Ready": ("False", "NoDeployment"), "Progressing": ("True", "Creating"), "Degraded": ("False", "AsExpected")}


def test_rollout_states() -> None:
    assert by_type(cond.rollout_conditions(deployment(2, 2, 2), 2)) == {
        "Ready": ("True", "ReplicasReady"), "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected")}
    rolling = by_type(cond.rollout_conditions(deployment(2, 1, 1), 2))
    assert rolling["Ready"] == ("True", "ReplicasReady") and rolling["Progressing"] == ("True", "RollingOut")
    assert by_type(cond.rollout_conditions(deployment(2, 1, 2, generation=3, observed=2), 2))["Progressing"] == \
        ("True", "RollingOut")  # the controller has not seen the new template yet
    assert by_type(cond.rollout_conditions(deployment(3, 2, 2, total=2), 3))["Progressing"] == ("True", "Scaling")
    assert by_type(cond.rollout_conditions(deployment(2, 0, 2), 2))["Ready"] == ("False", "NoReplicaReady")
    assert by_type(cond.rollout_conditions(deployment(2, 1, 2), 2))["Degraded"] == ("True", "ReplicasUnavailable")
    assert by_type(cond.rollout_conditions(deployment(0, 0, 0), 0))["Ready"] == ("False", "ScaledToZero")


def test_stuck_and_failing_rollouts_are_degraded() -> None:
    stuck = deployment(2, 1, 1, extra=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                        "message": "ReplicaSet has timed out progressing."}])
    states = by_type(cond.rollout_conditions(stuck, 2))
    assert states["Progressing"] == ("False", "RolloutStuck") and states["Degraded"] == ("True", "RolloutStuck")
    failing = deployment(2, 2, 2, extra=[{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                          "message": "exceeded quota"}])
    degraded = cond.find(cond.rollout_conditions(failing, 2), "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "ReplicaFailure", "exceeded quota")


def test_invalid_spec_keeps_a_serving_previous_spec_ready() -> None:
    assert "Ready" not in by_type(cond.invalid_spec("bad", 3, serving_previous=True))
    assert by_type(cond.invalid_spec("bad", 3, serving_previous=False))["Ready"] == ("False", "InvalidSpec")
    assert by_type(cond.awaiting_observation()) == {"SLOMet": ("Unknown", "AwaitingObservation"),
                                                    "PrefillCapacityExhausted": ("Unknown", "AwaitingObservation"),
                                                    "SLOFeasible": ("Unknown", "AwaitingObservation"),
                                                    "ServingPath": ("Unknown", "AwaitingObservation")}
