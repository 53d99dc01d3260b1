"""Status conditions of an InferenceService: building, merging, and reading them off the Deployment.

Conditions are plain dicts in the API's shape ({type, status, reason, message, lastTransitionTime,
observedGeneration}). Two writers share the list: the reconciler owns Ready, Progressing and Degraded;
the control loop owns SLOMet, PrefillCapacityExhausted, SLOFeasible and ServingPath. Each merges only its own types (the CRD
declares the list a map keyed by type), and a condition keeps its lastTransitionTime while its status
does not change.
"""
from __future__ import annotations

import datetime
from typing import Any, Iterable, Literal

Status = Literal["True", "False", "Unknown"]

READY = "Ready"
PROGRESSING = "Progressing"
SLO_MET = "SLOMet"
PREFILL_CAPACITY_EXHAUSTED = "PrefillCapacityExhausted"
SLO_FEASIBLE = "SLOFeasible"
SERVING_PATH = "ServingPath"  # False: a replica serves on a slower path than its compiled forward over the codes
DEGRADED = "Degraded"
RECONCILER_TYPES = (READY, PROGRESSING, DEGRADED)
CONTROL_LOOP_TYPES = (SLO_MET, PREFILL_CAPACITY_EXHAUSTED, SLO_FEASIBLE, SERVING_PATH)


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def condition(type_: str, status: Status, reason: str, message: str = "",
              generation: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type_, "status": status, "reason": reason, "message": message}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def find(conditions: Iterable[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    for item in conditions or ():
        if item.get("type") == type_:
            return item
    return None


def merge(current: list[dict[str, Any]] | None, updates: Iterable[dict[str, Any]],
          now: str | None = None) -> list[dict[str, Any]]:
    """Replace the updated types, keep the others; a transition time moves only when the status does."""
    now = now or now_iso()
    merged = {c["type"]: dict(c) for c in current or () if "type" in c}
    for update in updates:
        old = merged.get(update["type"])
        new = dict(update)
        if old is not None and old.get("status") == new["status"] and old.get("lastTransitionTime"):
            new["lastTransitionTime"] = old["lastTransitionTime"]
        else:
            new["lastTransitionTime"] = now
        merged[update["type"]] = new
    return list(merged.values())


def changed(current: list[dict[str, Any]] | None, updates: Iterable[dict[str, Any]]) -> bool:
    """Whether merging would change anything but nothing (saves a status write)."""
    for update in updates:
        old = find(current, update["type"])
        if old is None or any(old.get(k) != v for k, v in update.items()):
            return True
    return False


def awaiting_observation(generation: int | None = None) -> list[dict[str, Any]]:
    """What the control loop's conditions say before it has looked at any replica."""
    message = "the control loop has not observed a replica's window yet"
    return [condition(SLO_MET, "Unknown", "AwaitingObservation", message, generation),
            condition(PREFILL_CAPACITY_EXHAUSTED, "Unknown", "AwaitingObservation", message, generation),
            condition(SLO_FEASIBLE, "Unknown", "AwaitingObservation", message, generation),
            condition(SERVING_PATH, "Unknown", "AwaitingObservation", message, generation)]


def _not_deployed(reason: str, waiting: str, message: str, generation: int | None,
                  serving_previous: bool) -> list[dict[str, Any]]:
    """Nothing new is made; a running previous spec keeps serving (Ready stays as it was)."""
    out = [condition(DEGRADED, "True", reason, message, generation),
           condition(PROGRESSING, "False", reason, waiting, generation)]
    if not serving_previous:
        out.append(condition(READY, "False", reason, message, generation))
    return out


def invalid_spec(message: str, generation: int | None, serving_previous: bool) -> list[dict[str, Any]]:
    """A spec the operator cannot deploy."""
    return _not_deployed("InvalidSpec", "waiting for a corrected spec", message, generation, serving_previous)


def invalid_child(message: str, generation: int | None, serving_previous: bool) -> list[dict[str, Any]]:
    """A child the API server refused (422): the spec passed the schema but renders something invalid."""
    return _not_deployed("InvalidChild", "waiting for a spec the API server accepts", message, generation,
                         serving_previous)


def _deployment_condition(deployment: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return find((deployment.get("status") or {}).get("conditions"), type_)


def rollout_status(deployment: dict[str, Any] | None) -> dict[str, int]:
    """Replica counts for the InferenceService's status, as the Deployment reports them."""
    status = (deployment or {}).get("status") or {}
    return {"replicas": int(status.get("replicas") or 0),
            "readyReplicas": int(status.get("readyReplicas") or 0),
            "updatedReplicas": int(status.get("updatedReplicas") or 0)}


def rollout_conditions(deployment: dict[str, Any] | None, desired: int,
                       generation: int | None = None) -> list[dict[str, Any]]:
    """Ready, Progressing and Degraded from the daemons' Deployment (None: not made yet)."""
    if deployment is None:
        return [condition(READY, "False", "NoDeployment", "the daemons' Deployment does not exist yet", generation),
                condition(PROGRESSING, "True", "Creating", "creating the daemons", generation),
                condition(DEGRADED, "False", "AsExpected", "", generation)]
    counts = rollout_status(deployment)
    ready, updated, total = counts["readyReplicas"], counts["updatedReplicas"], counts["replicas"]
    observed = int((deployment.get("status") or {}).get("observedGeneration") or 0)
    current = observed >= int((deployment.get("metadata") or {}).get("generation") or 0)
    summary = f"{ready}/{desired} replicas ready"

    if desired == 0:
        ready_cond = condition(READY, "False", "ScaledToZero", "no replicas are wanted", generation)
    elif ready >= 1:
        ready_cond = condition(READY, "True", "ReplicasReady", summary, generation)
    else:
        ready_cond = condition(READY, "False", "NoReplicaReady", summary, generation)

    stuck = _deployment_condition(deployment, "Progressing")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    if stuck is not None and stuck.get("reason") == "ProgressDeadlineExceeded":
        progressing = condition(PROGRESSING, "False", "RolloutStuck", stuck.get("message", ""), generation)
        degraded = condition(DEGRADED, "True", "RolloutStuck", stuck.get("message", ""), generation)
    elif not current or updated < desired or total != desired:
        reason = "RollingOut" if updated < min(total, desired) or not current else "Scaling"
        progressing = condition(PROGRESSING, "True", reason, f"{updated} updated, {total} running, {summary}",
                                generation)
        degraded = condition(DEGRADED, "False", "AsExpected", "", generation)
    else:
        progressing = condition(PROGRESSING, "False", "RolloutComplete", summary, generation)
        degraded = (condition(DEGRADED, "True", "ReplicasUnavailable", summary, generation) if ready < desired
                    else condition(DEGRADED, "False", "AsExpected", "", generation))
    if failure is not None and failure.get("status") == "True":
        degraded = condition(DEGRADED, "True", "ReplicaFailure", failure.get("message", ""), generation)
    return [ready_cond, progressing, degraded]
