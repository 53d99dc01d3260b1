"""A closed-loop run as a timeline: one row per control step (p99s, budgets, replicas, decisions).

Shared by the CLI's printout and JSON, the PNG and the tests, so all three read the same figures.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stallfree.operator.control.loop import StepResult
from stallfree.operator.control.tuner import BUDGET_LOWERED, BUDGET_RAISED, HOLD

if TYPE_CHECKING:  # the virtual-time harness; the control loop itself never imports it
    from stallfree.simulator.closed_loop import ClosedLoopRun


def step_row(step: StepResult) -> dict[str, Any]:
    p99 = step.observed_p99()
    replicas = []
    for obs in step.observations:
        row: dict[str, Any] = {"name": obs.name, "known": obs.known}
        if obs.unknown_reason:
            row["unknown_reason"] = obs.unknown_reason
        if obs.stats is not None:
            s = obs.stats
            row.update(token_budget=s.tuning.token_budget, max_num_seqs=s.tuning.max_num_seqs,
                       p99_ttft_ms=s.ttft_ms.p99, p99_tpot_ms=s.tpot_ms.p99, p99_queue_wait_ms=s.queue_wait_ms.p99,
                       budget_utilisation=round(s.budget_utilisation, 3), kv_usage=round(s.kv_usage, 3),
                       num_waiting=s.num_waiting)
        replicas.append(row)
    decisions = [{"replica": d.replica, "kind": d.kind, "reason": d.reason, "message": d.message}
                 for d in step.tuning if d.kind != HOLD]
    if step.scale.changed:
        decisions.append({"replica": None, "kind": step.scale.kind, "reason": step.scale.reason,
                          "message": step.scale.message})
    fc = step.forecast
    return {
        "t": step.time,
        "replicas": step.scale.current,
        "desired_replicas": step.scale.desired,
        "ready_replicas": sum(1 for o in step.observations if o.ready),
        "p99_ttft_ms": p99["ttft_ms"],
        "p99_tpot_ms": p99["tpot_ms"],
        "p99_queue_wait_ms": p99["queue_wait_ms"],
        "replica_detail": replicas,
        # Requests waiting in the router's queue (with each replica's num_waiting: what the judge calls drained).
        "router_queued": step.queue.depth if step.queue is not None else None,
        "scale": {"kind": step.scale.kind, "reason": step.scale.reason, "message": step.scale.message},
        "decisions": decisions,
        "conditions": {c.type: c.status for c in step.conditions},
        "feasible": step.feasible_line,  # SLOFeasible's status and message, one line (live views)
        # The arrival rate one ready-delay ahead, its recent error, and whether the scaler sized from it.
        "arrival_tokens_per_s": _arrival_rate(step),
        "forecast_tokens_per_s": None if fc is None or fc.rate is None else round(fc.rate, 1),
        "forecast_error": None if fc is None or fc.error is None else round(fc.error, 3),
        "forecast_trusted": bool(fc is not None and fc.trusted),
    }


def _arrival_rate(step: StepResult) -> float | None:
    """Prompt tokens/s that arrived at the router over the last interval (what the forecast is fitted on)."""
    q = step.queue
    return None if q is None or q.recent_s <= 0 else round(q.recent_prompt_tokens / q.recent_s, 1)


def timeline(run: "ClosedLoopRun") -> list[dict[str, Any]]:
    return [step_row(step) for step in run.steps]


def budget_reversals(run: "ClosedLoopRun") -> int:
    """Changes of direction of each replica's budget moves (raise after lower or lower after raise), summed."""
    last: dict[str, str] = {}
    reversals = 0
    for step in run.steps:
        for d in step.tuning:
            if d.kind in (BUDGET_LOWERED, BUDGET_RAISED):
                if d.replica in last and last[d.replica] != d.kind:
                    reversals += 1
                last[d.replica] = d.kind
    return reversals


def format_row(row: dict[str, Any]) -> str:
    """One line of the printed timeline."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    budgets = ",".join(str(r.get("token_budget", "?")) if r["known"] else f"{r.get('token_budget', '?')}?"
                       for r in row["replica_detail"])
    text = (f"t={row['t']:6.0f}s  p99 TTFT {ms(row['p99_ttft_ms']):>6} TPOT {ms(row['p99_tpot_ms']):>4} "
            f"queue {ms(row['p99_queue_wait_ms']):>6} ms  budget {budgets:<16} replicas {row['replicas']}"
            f"->{row['desired_replicas']} (ready {row['ready_replicas']})")
    notes = [f"{d['replica'] + ': ' if d['replica'] else ''}{d['kind']} ({d['reason']})" for d in row["decisions"]]
    unknown = [f"{r['name']} unknown" for r in row["replica_detail"] if not r["known"]]
    if row.get("forecast_tokens_per_s") is not None:
        err = row.get("forecast_error")
        text += (f"  forecast {row['forecast_tokens_per_s']:.0f} tok/s "
                 f"(err {'-' if err is None else f'{err:.0%}'}{'' if row.get('forecast_trusted') else ', reactive'})")
    return text + ("  " + "; ".join(notes + unknown) if notes or unknown else "")
