"""What the status says of each objective: its p99s and goodput over the router's window, and whether it is
feasible at maxReplicas. Pure.

An objective is feasible when its own demand and that of every band above it fit maxReplicas' prefill capacity
at the scale-up utilisation (the bands below wait or are shed; a sheddable objective that does not fit is
shed in part, by design). Unknown (None) while one replica's capacity or the demand is unknown.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from stallfree.operator.control.observe import ObjectiveWindow, QueueObservation
from stallfree.operator.control.policy import ControlPolicy


@dataclass(frozen=True)
class ObjectiveStatus:
    window: ObjectiveWindow
    feasible: bool | None
    demand_above_tokens_per_s: float | None  # its band's and the higher bands' demand

    def to_status(self) -> dict[str, Any]:
        w = self.window
        return {"name": w.name, "priority": w.priority, "sheddable": w.sheddable,
                "p99TtftMs": _r(w.ttft_p99_ms), "p99TpotMs": _r(w.tpot_p99_ms),
                "p99QueueWaitMs": _r(w.queue_wait_p99_ms),
                "goodput": None if w.goodput is None else round(w.goodput, 4), "completed": w.completed,
                "shed": w.shed, "queued": w.depth,
                "demandTokensPerS": _r(w.arrival_prompt_tokens_per_s), "feasible": self.feasible}


def objective_statuses(queue: QueueObservation | None, policy: ControlPolicy,
                       capacity_per_replica: float | None) -> list[ObjectiveStatus]:
    windows = sorted(queue.objectives if queue is not None else (), key=lambda w: (-w.priority, w.name))
    scaling = policy.scaling
    limit = capacity_per_replica * scaling.max_replicas * scaling.scale_up_utilisation if capacity_per_replica \
        else None
    out = []
    for w in windows:
        rates = [v.arrival_prompt_tokens_per_s for v in windows if v.priority >= w.priority]
        above = None if any(r is None for r in rates) else sum(r or 0.0 for r in rates)
        feasible = None if limit is None or above is None else above <= limit
        out.append(ObjectiveStatus(w, feasible, above))
    return out


def goodput(windows: Sequence[ObjectiveWindow]) -> float | None:
    """The service's goodput over the window: requests that met every SLO of their objective, of all judged."""
    judged = sum(w.completed + w.shed for w in windows)
    return sum(w.good for w in windows) / judged if judged else None


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
