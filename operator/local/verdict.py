"""The verdict of a `stallfree up --demo` run: for each load phase, which SLO breached, how many control
intervals until it was back under, the budget path and the replica count; and whether every SLO was met at
the end. Pure: timeline rows (operator/control/timeline.step_row) in, a verdict out.

A window p99 that is unknown (no replica had enough samples) neither breaches nor restores an SLO, and a window
with a replica unknown cannot restore one (the worst known replica may not be the worst). A breach
that lasts into a later phase is counted once, where it began. An unrestored breach is excused only when the
control loop itself judged that SLO infeasible (SLOFeasible=False) at the last step it could judge, the
run's end: a loop that thought an SLO reachable and did not reach it failed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

# SLO name -> the timeline row's key, in the order the tuner protects them (TPOT first).
SLO_KEYS = {"tpot": "p99_tpot_ms", "queue_wait": "p99_queue_wait_ms", "ttft": "p99_ttft_ms"}


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
    verdicts = []
    open_until = {slo: -1.0 for slo in SLO_KEYS}  # an SLO's latest breach ends (is restored) at this time
    latest: dict[str, Breach] = {}
    for phase in phases:
        in_phase = [r for r in rows if phase.start_s <= r["t"] < phase.end_s]
        verdict = PhaseVerdict(phase)
        if in_phase:
            verdict.replicas_start = in_phase[0]["replicas"]
            verdict.replicas_end = in_phase[-1]["desired_replicas"]
            verdict.replicas_max = max(r["desired_replicas"] for r in in_phase)
            verdict.budget_path = _budget_path(in_phase)
        for slo, key in SLO_KEYS.items():
            target = slos_ms[slo]
            known = [r[key] for r in in_phase if r.get(key) is not None]
            verdict.within[slo] = (sum(v <= target for v in known) / len(known)) if known else None
            if slo in latest and in_phase and open_until[slo] > in_phase[0]["t"]:
                verdict.carried.append(latest[slo])  # still over the SLO past this phase's first window
            for row in in_phase:  # every breach that starts in this phase, each followed to its restore
                if row["t"] <= open_until[slo] or not _above(row.get(key), target):
                    continue
                breach = Breach(slo, target, row["t"], row[key], feasible=slo not in judged_end)
                for count, later in enumerate((r for r in rows if r["t"] > row["t"]), start=1):
                    value = later.get(key)
                    if value is not None and value > target:
                        breach.worst_ms = max(breach.worst_ms, value)
                    elif value is not None and _all_known(later):
                        breach.restored_at_s, breach.intervals_to_restore = later["t"], count
                        break
                verdict.breaches.append(breach)
                latest[slo] = breach
                open_until[slo] = breach.restored_at_s if breach.restored else float("inf")
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


def _all_known(row: dict[str, Any]) -> bool:
    """Every replica of the window was known (rows without replica detail: taken as known). A replica read with
    nothing waiting counts as known though its window had too few samples to judge: an idle replica hides no
    backlog (after a scale-out, light load may leave one idle and it would never let a restore count)."""
    return all(d.get("known", True) or d.get("num_waiting") == 0 for d in row.get("replica_detail", ()))


def _above(value: float | None, target: float) -> bool:
    return value is not None and value > target


def _budget_path(rows: Sequence[dict[str, Any]]) -> list[int]:
    """The first replica's budget each time it changed (unknown windows skipped)."""
    path: list[int] = []
    for row in rows:
        budgets = [d.get("token_budget") for d in row["replica_detail"] if d.get("token_budget")]
        if budgets and (not path or path[-1] != budgets[0]):
            path.append(budgets[0])
    return path
