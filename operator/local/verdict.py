"""The verdict of a `stallfree up --demo` run: for each load phase, which SLO breached, how many control
intervals until it was back under, the budget path and the replica count; and whether every SLO was met at
the end. Pure: timeline rows (operator/control/timeline.step_row) in, a verdict out.

Breaches and restores are the scenarios' judge's (simulator/closed_loop_judge.breaches): a window p99 that is
unknown neither breaches nor restores an SLO, and a window with a replica unknown cannot restore one. A breach
that lasts into a later phase is counted once, where it began. An unrestored breach is excused only when the
control loop itself judged that SLO infeasible (SLOFeasible=False) at the last step it could judge, the
run's end: a loop that thought an SLO reachable and did not reach it failed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from stallfree.simulator.closed_loop_judge import SLOS, breaches, within_share

# SLO name -> the timeline row's key, in the order the tuner protects them (TPOT first).
SLO_KEYS = {name: column for name, column, _, _ in SLOS}


@dataclass(frozen=True)
class Phase:
    label: str
    start_s: float
    end_s: float


@dataclass
class Breach:
    slo: str
    target_ms: float
    at_s: float
    worst_ms: float
    restored_at_s: float | None = None
    intervals_to_restore: int | None = None
    feasible: bool = True

    @property
    def restored(self) -> bool:
        return self.restored_at_s is not None


@dataclass
class PhaseVerdict:
    phase: Phase
    breaches: list[Breach] = field(default_factory=list)
    budget_path: list[int] = field(default_factory=list)
    replicas_start: int | None = None
    replicas_end: int | None = None
    replicas_max: int | None = None
    within: dict[str, float | None] = field(default_factory=dict)  # share of known windows within each SLO
    carried: list[Breach] = field(default_factory=list)  # breaches from earlier phases still open at its start


@dataclass
class Verdict:
    phases: list[PhaseVerdict]
    met_at_end: dict[str, bool | None]  # per SLO over the last windows; None where nothing was known
    infeasible: dict[str, str]  # SLO -> the loop's own message, where it judged the SLO infeasible at the end
    infeasible_earlier: dict[str, str] = field(default_factory=dict)  # judged infeasible only for a while

    @property
    def failed(self) -> list[Breach]:
        """Breaches of feasible SLOs that the loop never restored: what makes `up --demo` exit non-zero."""
        return [b for p in self.phases for b in p.breaches if b.feasible and not b.restored]

    @property
    def ok(self) -> bool:
        return not self.failed and all(v is not False for s, v in self.met_at_end.items() if s not in self.infeasible)


def judge(rows: Sequence[dict[str, Any]], phases: Sequence[Phase], slos_ms: dict[str, float],
          infeasible: dict[str, str] | None = None, end_windows: int = 3) -> Verdict:
    """Every breach that starts in a phase, followed to its restore (which may come in a later phase).

    `infeasible`: SLO -> the loop's message where it judged the SLO infeasible. Rows may carry the loop's
    judgement of each step (`infeasible`: the SLO names, None where it could not judge); without it, the
    judgement in `infeasible` holds for the whole run."""
    infeasible = dict(infeasible or {})
    judged_end = _judged_at_end(rows, infeasible)
    times = [r["t"] for r in rows]
    found = {slo: [Breach(slo, slos_ms[slo], b.start_s, b.worst_ms, b.restored_s,
                          None if b.restored_s is None else sum(1 for t in times if b.start_s < t <= b.restored_s),
                          slo not in judged_end) for b in breaches(rows, key, slos_ms[slo])]
             for slo, key in SLO_KEYS.items()}
    verdicts = []
    for phase in phases:
        in_phase = [r for r in rows if phase.start_s <= r["t"] < phase.end_s]
        verdict = PhaseVerdict(phase)
        if in_phase:
            verdict.replicas_start = in_phase[0]["replicas"]
            verdict.replicas_end = in_phase[-1]["desired_replicas"]
            verdict.replicas_max = max(r["desired_replicas"] for r in in_phase)
            verdict.budget_path = _budget_path(in_phase)
        for slo, key in SLO_KEYS.items():
            verdict.within[slo] = within_share([r[key] for r in in_phase if r.get(key) is not None], slos_ms[slo])
            earlier = [b for b in found[slo] if b.at_s < phase.start_s]
            if earlier and in_phase and (not earlier[-1].restored or earlier[-1].restored_at_s > in_phase[0]["t"]):
                verdict.carried.append(earlier[-1])  # still over the SLO past this phase's first window
            verdict.breaches += [b for b in found[slo] if phase.start_s <= b.at_s < phase.end_s]
        verdicts.append(verdict)
    last = rows[-end_windows:]
    met_at_end: dict[str, bool | None] = {}
    for slo, key in SLO_KEYS.items():
        known = [r[key] for r in last if r.get(key) is not None]
        met_at_end[slo] = None if not known else all(v <= slos_ms[slo] for v in known)
    return Verdict(verdicts, met_at_end, {s: m for s, m in infeasible.items() if s in judged_end},
                   {s: m for s, m in infeasible.items() if s not in judged_end})


def _judged_at_end(rows: Sequence[dict[str, Any]], infeasible: dict[str, str]) -> set[str]:
    """The SLOs the loop judged infeasible at its last step that could judge (all of `infeasible` when the
    rows do not carry the loop's judgement)."""
    judged = [r["infeasible"] for r in rows if "infeasible" in r and r["infeasible"] is not None]
    if not any("infeasible" in r for r in rows):
        return set(infeasible)
    return set(judged[-1]) if judged else set()


def verdict_text(verdict: Verdict, interval_s: float) -> list[str]:
    names = {"tpot": "TPOT", "queue_wait": "queue wait", "ttft": "TTFT"}
    lines = ["verdict:"]
    for p in verdict.phases:
        budgets = "->".join(map(str, p.budget_path)) or "-"
        replicas = "-" if p.replicas_start is None else (
            f"{p.replicas_start}" if p.replicas_start == p.replicas_end == p.replicas_max
            else f"{p.replicas_start}->{p.replicas_end} (max {p.replicas_max})")
        head = f"  {p.phase.label:<20} budget {budgets:<22} replicas {replicas}"
        if not p.breaches and not p.carried:
            lines.append(head + "   every SLO held")
            continue
        lines.append(head)
        for b in p.carried:
            end = (f"back under at {b.restored_at_s:.0f}s" if b.restored else "never back under")
            lines.append(f"    {names[b.slo]}: the breach from {b.at_s:.0f}s goes on ({end})")
        for slo in SLO_KEYS:
            mine = [b for b in p.breaches if b.slo == slo]
            if not mine:
                continue
            first, last = mine[0], mine[-1]
            what = (f"    {names[slo]} breached at {first.at_s:.0f}s (worst p99 {max(b.worst_ms for b in mine):.0f} ms > "
                    f"{first.target_ms:.0f} ms)")
            if first.restored:
                what += f", back under after {first.intervals_to_restore} interval(s) ({first.restored_at_s - first.at_s:.0f}s)"
            if len(mine) > 1:
                what += f"; {len(mine) - 1} more breach(es) in the phase"
            if not last.restored:
                what += (", last not restored: judged infeasible (SLOFeasible=False)" if not last.feasible
                         else ", last NOT restored")
            share = p.within.get(slo)
            if share is not None:
                what += f"; {100 * share:.0f}% of windows within"
            lines.append(what)
    for slo, message in verdict.infeasible.items():
        lines.append(f"  SLOFeasible=False for {names.get(slo, slo)} (to the end): {message}")
    for slo, message in verdict.infeasible_earlier.items():
        lines.append(f"  SLOFeasible=False for {names.get(slo, slo)} for a while (feasible again by the end): "
                     f"{message}")
    end = ", ".join(f"{names[s]} {'met' if v else 'unknown' if v is None else 'MISSED'}"
                    for s, v in verdict.met_at_end.items())
    lines.append(f"  at the end (last windows, {interval_s:.0f}s apart): {end}")
    lines.append("  result: " + ("every feasible SLO was restored" if verdict.ok else
                                 f"FAILED: {len(verdict.failed)} breach(es) of a feasible SLO not restored"
                                 if verdict.failed else "FAILED: an SLO was missed at the end"))
    return lines


def _budget_path(rows: Sequence[dict[str, Any]]) -> list[int]:
    """The first replica's budget each time it changed (unknown windows skipped)."""
    path: list[int] = []
    for row in rows:
        budgets = [d.get("token_budget") for d in row["replica_detail"] if d.get("token_budget")]
        if budgets and (not path or path[-1] != budgets[0]):
            path.append(budgets[0])
    return path
