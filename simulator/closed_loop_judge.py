"""Every SLO judged over a closed-loop run's timeline: windows within, breach-to-restore times, reversals. The one
judge of breach and restore: the scenarios' goals and `up --demo`'s verdict (operator/local/verdict.py) both read
the timeline's rows through `breaches`.

Works on the timeline rows (operator/control/timeline.py) so a saved JSON can be judged again. A window
whose p99 is unknown (no known replica) counts neither for nor against; a breach is restored by the first window
back within the SLO with every replica known (a replica unknown may be the worst). The goals:
- after a load step the backlog is drained within 3 control intervals of the new replicas being ready (what
  the loop controls); for queue wait and TTFT the window's clear-out (the p99 window still holds requests
  that waited through the breach, `window_s` longer) is printed beside it, not counted against it. TPOT,
  which no backlog holds, is restored within 3 intervals of ready;
- >= 95% of windows within every feasible SLO after the scenario's first breach;
- replica-minutes at most 1.15x the oracle's (closed_loop_oracle.py);
- at most one direction change (replicas, and each replica's budget) per load change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

# (name, timeline column, SLO key, label)
SLOS = (("tpot", "p99_tpot_ms", "tpot_p99_ms", "TPOT"),
        ("queue_wait", "p99_queue_wait_ms", "queue_wait_p99_ms", "queue wait"),
        ("ttft", "p99_ttft_ms", "ttft_p99_ms", "TTFT"))
RESTORE_INTERVALS, WINDOW_FRACTION, OVER_ORACLE = 3, 0.95, 1.15


@dataclass(frozen=True)
class Breach:
    """A run of windows over an SLO: from the first over it to the first back within it (None: never)."""

    start_s: float
    restored_s: float | None
    worst_ms: float


def breaches(rows: Sequence[dict[str, Any]], column: str, limit: float) -> list[Breach]:
    """Each breach of `limit` in the timeline's `column`, in time order. Unknown windows (None) are skipped; a
    window within the limit restores only when every replica of it was known (`all_known`)."""
    out: list[Breach] = []
    start, worst = None, 0.0
    for row in rows:
        value = row.get(column)
        if value is None:
            continue
        if value > limit:
            start, worst = (row["t"], value) if start is None else (start, max(worst, value))
        elif start is not None and all_known(row):
            out.append(Breach(start, row["t"], worst))
            start = None
    if start is not None:
        out.append(Breach(start, None, worst))
    return out


def within_share(values: Sequence[float], limit: float) -> float | None:
    """The share of known windows within `limit` (None: none known)."""
    return sum(1 for v in values if v <= limit) / len(values) if values else None


def all_known(row: dict[str, Any]) -> bool:
    """Every replica of the window was known (rows without replica detail: taken as known). A replica read with
    nothing waiting counts as known though its window had too few samples to judge: an idle replica hides no
    backlog (after a scale-out, light load may leave one idle and it would never let a restore count)."""
    return all(d.get("known", True) or d.get("num_waiting") == 0 for d in row.get("replica_detail", ()))


def judge(rows: Sequence[dict[str, Any]], slo: dict[str, float], interval_s: float, load_changes: int,
          infeasible: Sequence[str] = (), window_s: float | None = None) -> dict[str, Any]:
    """Per-SLO figures and the goals they meet. `infeasible`: SLO keys no replica count could meet (oracle).

    Each queue-wait and TTFT restore also says what bounded it, measured: when the backlog was drained
    (nothing waiting at the router or on a replica), and the first step whose `window_s` p99 window no
    longer holds a request scheduled before that (a request that waited through the breach is scheduled
    as the backlog drains, and stays in the window that long).
    """
    first_breach = min((r["t"] for r in rows for _, col, key, _ in SLOS
                        if r[col] is not None and r[col] > slo[key]), default=None)
    ready_at = _ready_times(rows)
    per_slo = {}
    for name, col, key, label in SLOS:
        limit = slo[key]
        known = [(r["t"], r[col]) for r in rows if r[col] is not None]
        after = [(t, v) for t, v in known if first_breach is not None and t > first_breach]
        within = sum(1 for _, v in after if v <= limit)
        episodes = breaches(rows, col, limit)
        restores = []
        for start, end in ((b.start_s, b.restored_s) for b in episodes):
            ready = max([t for t in ready_at if t <= (end if end is not None else float("inf"))] + [start])
            base = max(start, ready)
            drained = _drained_at(rows, base) if name != "tpot" else None
            earliest = None if drained is None or window_s is None else \
                max(base, interval_s * math.ceil((drained + window_s) / interval_s - 1e-9))
            after_ready = None if end is None else round((end - base) / interval_s, 1)
            drained_after = None if drained is None else round((drained - base) / interval_s, 1)
            restores.append({"breach_s": start, "restored_s": end,
                             "restore_s": None if end is None else end - start,
                             "intervals_after_ready": after_ready,
                             "backlog_drained_s": drained,
                             "backlog_drained_intervals_after_ready": drained_after,
                             # What the restore goal counts: the backlog drained (queue wait, TTFT), TPOT's window.
                             "judged_intervals_after_ready": after_ready if name == "tpot" else drained_after,
                             "backlog_window_clear_intervals_after_ready":
                                 None if earliest is None else round((earliest - base) / interval_s, 1)})
        per_slo[name] = {
            "label": label, "slo_ms": limit, "feasible": name not in infeasible,
            "windows": len(known),
            "window_fraction": round(within_share([v for _, v in known], limit), 3) if known else None,
            "window_fraction_after_first_breach": round(within / len(after), 3) if after else 1.0,
            "breaches": len(episodes),
            "restores": restores,
            "worst_intervals_after_ready": max((x["judged_intervals_after_ready"]
                                                if x["judged_intervals_after_ready"] is not None
                                                else float("inf") for x in restores), default=0.0),
        }
    replica_reversals = _reversals([r["replicas"] for r in rows] + [rows[-1]["desired_replicas"]] if rows else [])
    budget_reversals = max((_reversals(series) for series in _budget_series(rows).values()), default=0)
    feasible = [v for v in per_slo.values() if v["feasible"]]
    worst = min((v["window_fraction_after_first_breach"] for v in per_slo.values()), default=1.0)
    goals = {
        "backlog_drained_within_3_intervals_of_ready": all(v["worst_intervals_after_ready"] <= RESTORE_INTERVALS
                                                    for v in feasible),
        "95pct_windows_within_every_feasible_slo": all(v["window_fraction_after_first_breach"] >= WINDOW_FRACTION
                                                       for v in feasible),
        "at_most_one_reversal_per_load_change": max(replica_reversals, budget_reversals) <= max(1, load_changes),
    }
    return {"first_breach_s": first_breach, "slos": per_slo, "slo_window_fraction": worst,
            "replica_reversals": replica_reversals, "budget_reversals": budget_reversals,
            "load_changes": load_changes, "replica_minutes": replica_minutes(rows, interval_s), "goals": goals}


def replica_minutes(rows: Sequence[dict[str, Any]], interval_s: float) -> float:
    """Replicas paid for (asked for: starting or serving) over the run, in replica-minutes."""
    return round(sum(r["replicas"] for r in rows) * interval_s / 60.0, 2)


def _drained_at(rows: Sequence[dict[str, Any]], since: float) -> float | None:
    """The first step at or after `since` with nothing waiting: the router's queue empty and no known replica
    holding more than one request waiting (one that just arrived is not a backlog)."""
    for r in rows:
        if r["t"] < since:
            continue
        if (r.get("router_queued") or 0) == 0 and all((d.get("num_waiting") or 0) <= 1
                                                      for d in r["replica_detail"] if d["known"]):
            return r["t"]
    return None


def _ready_times(rows: Sequence[dict[str, Any]]) -> list[float]:
    """When the replicas of each scale-up were all ready: the service runs the count asked for (or what a later
    decision lowered it to) and that many are ready. Not at the step that asked: its row still shows the old
    count, every one of them ready."""
    times, waiting_for = [], None
    for r in rows:
        if r["desired_replicas"] > r["replicas"]:
            waiting_for = r["desired_replicas"]
            continue
        if waiting_for is not None:
            target = min(waiting_for, r["desired_replicas"])
            if r["replicas"] >= target and r["ready_replicas"] >= target:
                times.append(r["t"])
                waiting_for = None
    return times


def _budget_series(rows: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    series: dict[str, list[int]] = {}
    for r in rows[1:]:  # from the tuner's start on: its first move sets the starting point
        for d in r["replica_detail"]:
            if d.get("token_budget") is not None:
                series.setdefault(d["name"], []).append(d["token_budget"])
    return series


def _reversals(values: Sequence[int]) -> int:
    moves = [b - a for a, b in zip(values, values[1:]) if b != a]
    return sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))


def _restore(restore: dict[str, Any], by_window: bool) -> str:
    """'drained D (window T, clear at C)': the judged figure first, the window's own restore beside it."""
    window = "never" if restore["restore_s"] is None else \
        f"{restore['restore_s']:.0f}s, {restore['intervals_after_ready']:g} after ready"
    if by_window:
        return window  # TPOT: no backlog holds it, its window is what is judged
    drained = restore.get("backlog_drained_intervals_after_ready")
    clear = restore.get("backlog_window_clear_intervals_after_ready")
    clear_text = "" if clear is None else f", its window clear at {clear:g}"
    return f"drained {'never' if drained is None else f'{drained:g}'} (window {window}{clear_text})"


def format_table(name: str, judged: dict[str, Any], oracle: dict[str, Any] | None) -> list[str]:
    """The per-scenario table the CLI prints."""
    lines = [f"  {'SLO':<11}{'p99 SLO':>9}{'windows within':>16}{'after 1st breach':>18}{'breaches':>10}  "
             f"restore: intervals after ready"]
    for v in judged["slos"].values():
        restores = "; ".join(_restore(x, v["label"] == "TPOT") for x in v["restores"][:6]) or "-"
        if len(v["restores"]) > 6:
            restores += f", ... ({len(v['restores'])})"
        frac = "-" if v["window_fraction"] is None else f"{v['window_fraction']:.0%}"
        mark = "" if v["feasible"] else " (infeasible)"
        lines.append(f"  {v['label'] + mark:<11}{v['slo_ms']:>7g}ms{frac:>16}"
                     f"{v['window_fraction_after_first_breach']:>18.0%}{v['breaches']:>10}  {restores}")
    over = ""
    if oracle is not None:
        ratio = oracle.get("replica_minutes_over_oracle")
        over = (f" vs oracle {oracle['replica_minutes']:.1f} ({ratio:.2f}x), oracle windows within every SLO "
                f"{oracle['slo_window_fraction']:.0%}")
    lines.append(f"  replica-minutes {judged['replica_minutes']:.1f}{over}; reversals: replicas "
                 f"{judged['replica_reversals']}, budget {judged['budget_reversals']} over {judged['load_changes']} "
                 f"load change(s)")
    return lines
