"""What a local run leaves: report.json (timeline, events, client latencies, the demo's verdict), the timeline
plot, and the summary printed at the end."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from stallfree.operator.api.spec import InferenceServiceSpec
from stallfree.operator.local.demo_run import DemoRun
from stallfree.operator.local.load import LoadDriver, LoadPhase
from stallfree.operator.local.runtime import LocalRuntime
from stallfree.operator.local.verdict import Phase, judge, verdict_text


def report(name: str, spec: InferenceServiceSpec, runtime: LocalRuntime, load: LoadDriver | None,
           demo: DemoRun | None, out: Path) -> dict[str, Any]:
    from stallfree.operator.control.timeline import step_row

    rows = []
    for step in runtime.steps:
        row = step_row(step)
        row["t"] = round(step.time - runtime.started, 1)
        row["infeasible"] = judged_infeasible(step)
        rows.append(row)
    starts = load.phase_starts if load else []
    phases = demo.phases if demo else []
    background = demo.background if demo else []
    slo = runtime.policy.slo
    result = {
        "scenario": "up --demo" if load else "up",
        "title": f"stallfree up -f {name}" + (" --demo" if load else ""),
        "time_label": "wall time since start (s)",
        "service": name,
        "model": spec.model.daemon_model,
        "hardware": spec.engine.device,
        "slo": {"ttft_p99_ms": slo.ttft_p99_ms, "tpot_p99_ms": slo.tpot_p99_ms,
                "queue_wait_p99_ms": slo.queue_wait_p99_ms},
        "load": [dict(p.to_dict(), start_s=round(t, 1)) for t, p in starts if p not in background],
        "background_load": [dict(p.to_dict(), start_s=round(t, 1)) for t, p in starts if p in background],
        "timeline": rows,
        "events": [e.__dict__ for e in runtime.events],
        "client": load.summary() if load else {},
        "restarts": runtime.daemons.total_restarts,
    }
    if demo is not None:
        cal = demo.calibration
        result["calibration"] = None if cal is None else {"factor": cal.factor, "windows": cal.windows,
                                                          "spread": list(cal.spread),
                                                          "long_prompt_factor": cal.long_prompt_factor,
                                                          "message": cal.describe()}
    if load and phases:
        result["verdict"] = demo_verdict(rows, starts, phases, runtime)
        per_objective = objectives_verdict(load, demo)
        if per_objective is not None:
            result["verdict"]["objectives"] = per_objective
            result["verdict"]["ok"] = result["verdict"]["ok"] and per_objective["ok"]
            lines = result["verdict"]["lines"]
            lines[-1:-1] = per_objective["lines"]  # before the result line, which now says both
            if not per_objective["ok"]:
                lines[-1] = "  result: FAILED: an objective missed its goal in the batch phase" + (
                    "" if lines[-1].endswith("every feasible SLO was restored") else f" ({lines[-1].strip()})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str))
    if rows:
        from stallfree.simulator.closed_loop_plot import plot_timeline

        plot_timeline(result, str(out / "timeline.png"))
    return result


def demo_verdict(rows: list[dict[str, Any]], starts: list[tuple[float, LoadPhase]], phases: list[LoadPhase],
                 runtime: LocalRuntime) -> dict[str, Any]:
    """Per phase: which SLO breached and how many control intervals until it was back under."""
    timed = [(t, p) for t, p in starts if p in phases]
    windows = [Phase(p.label, t, timed[i + 1][0] if i + 1 < len(timed) else float("inf"))
               for i, (t, p) in enumerate(timed)]
    slo = runtime.policy.slo
    verdict = judge(rows, windows, {"tpot": slo.tpot_p99_ms, "ttft": slo.ttft_p99_ms,
                                    "queue_wait": slo.queue_wait_p99_ms},
                    infeasible=infeasible_slos(runtime))
    return {"ok": verdict.ok, "failed": len(verdict.failed), "met_at_end": verdict.met_at_end,
            "lines": verdict_text(verdict, runtime.policy.interval_s),
            "phases": [dataclasses.asdict(p) for p in verdict.phases]}


def objectives_verdict(load: LoadDriver, demo: DemoRun) -> dict[str, Any] | None:
    """Per objective over the batch phase (objective_verdict.py): the chat sent during it and the batch flood;
    None when the run had no batch phase (no router, or stopped before it)."""
    from stallfree.operator.local.demo import BATCH_PHASE, CHAT_OBJECTIVE
    from stallfree.operator.local.objective_verdict import judge_objectives, objective_lines

    timed = sorted(t for t, p in load.phase_starts if p in demo.phases)
    starts = [t for t, p in load.phase_starts if p.label == BATCH_PHASE]
    if not starts:
        return None
    start = starts[0]
    end = next((t for t in timed if t > start), float("inf"))
    objectives = demo.objectives
    by_objective: dict[str, list] = {}
    for record in load.results:
        if record.phase == BATCH_PHASE:
            name = record.objective or objectives.default.name
        elif start <= record.result.scheduled_s < end:
            name = record.objective or CHAT_OBJECTIVE
        else:
            continue
        by_objective.setdefault(name, []).append(record.result)
    verdicts = judge_objectives(by_objective, sorted(objectives.by_name.values(), key=lambda o: -o.priority))
    return {"ok": all(v.ok for v in verdicts), "phase": BATCH_PHASE, "lines": objective_lines(verdicts, BATCH_PHASE),
            "objectives": [dict(dataclasses.asdict(v), ok=v.ok) for v in verdicts]}


VERDICT_NAMES = {"tpot": "tpot", "queueWait": "queue_wait", "ttft": "ttft"}


def judged_infeasible(step: Any) -> list[str] | None:
    """The SLOs this control step judged infeasible from the profile (verdict names); None: it could not judge."""
    feasibility = getattr(step, "feasibility", None)
    if feasibility is None or not feasibility.known:
        return None
    return [VERDICT_NAMES.get(slo, slo) for slo in feasibility.infeasible]


def infeasible_slos(runtime: LocalRuntime) -> dict[str, str]:
    """SLO -> the loop's latest message where it judged that SLO infeasible during the run (SLOFeasible=False)."""
    found: dict[str, str] = {}
    for step in runtime.steps:
        for slo in judged_infeasible(step) or ():
            found[slo] = step.feasibility.message
    return found


def summary_text(result: dict[str, Any], out: Path) -> str:
    rows = result["timeline"]
    budgets = [d.get("token_budget") for r in rows for d in r["replica_detail"] if d.get("token_budget")]
    lines = ["", f"== stallfree up: {result['service']} ({result['model']} on {result['hardware']}) =="]
    if budgets:
        lines.append(f"token budget: started {budgets[0]}, ended {budgets[-1]} "
                     f"(min {min(budgets)}, max {max(budgets)})")
    if rows:
        lines.append(f"replicas: started {rows[0]['replicas']}, max {max(r['desired_replicas'] for r in rows)}, "
                     f"ended {rows[-1]['desired_replicas']}")
    kinds: dict[str, int] = {}
    for e in result["events"]:
        kinds[e["reason"]] = kinds.get(e["reason"], 0) + 1
    if kinds:
        lines.append("events: " + ", ".join(f"{k} x{v}" for k, v in kinds.items()))
    slo = result["slo"]
    for label, s in result["client"].items():
        if label == "all":
            continue
        shed = f", {s['shed']} shed" if s.get("shed") else ""
        lines.append(f"  {label:<20} {s['completed']}/{s['requests']} done{shed}  client p99 TTFT {_ms(s['ttft_ms'])} "
                     f"TPOT {_ms(s['tpot_ms'])} (SLO {slo['tpot_p99_ms']:.0f})")
    if result["client"]:
        total = result["client"]["all"]
        lines.append(f"requests: {total['requests']} sent, {total['completed']} completed, {total.get('shed', 0)} shed "
                     f"at arrival, {total['failed']} failed"
                     + (f" ({total['errors']})" if total["errors"] else ""))
    if "verdict" in result:
        lines += result["verdict"]["lines"]
    lines.append(f"report: {out / 'report.json'}   plots: {out / 'timeline.png'}")
    return "\n".join(lines)


def _ms(summary: dict[str, Any]) -> str:
    value = summary.get("p99")
    return "-" if value is None else f"{value:.0f} ms"
