"""Closed-loop scenarios on predictable load (scaling ahead of it), and the goals they add.

- sinusoid: 1x <-> 24x the base rate over a 10-minute period, as Dynamo #10528's 1 <-> 24 req/s; goal: goodput
  (the share of the simulated requests that met every SLO: TTFT, TPOT and queue wait) >= 95% at <= 1.15x the
  oracle's replica-minutes (the common goal).
- ramp's goal: it starts at about 2.2x one replica's capacity, so its first breach is the start's; once that
  backlog is drained and has left the p99 window, no window over any feasible SLO while the load climbs.

Builders import the common scenario module lazily: it registers these, so importing it here at the top would
be circular.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from stallfree.latency import within_targets
from stallfree.simulator.closed_loop import ClosedLoopRun, LoadPhase
from stallfree.simulator.closed_loop_judge import SLOS, _drained_at
from stallfree.simulator.workload import parse_length
from stallfree.operator.control.timeline import timeline

if TYPE_CHECKING:
    from stallfree.simulator.closed_loop_scenarios import Scenario

GOODPUT_GOAL = 0.95
SINUSOID_PERIOD_S, SINUSOID_LOW, SINUSOID_PEAK, SINUSOID_STEPS = 600.0, 1.0, 24.0, 20
SINUSOID_BASE_RATE = 0.25  # requests/s at 1x: 24x is about 6 of scale-out's replicas


def sinusoid_phases(base_rate: float, low: float, peak: float, period_s: float, steps: int, duration_s: float,
                    prompt, output) -> list[LoadPhase]:
    """The sinusoid as `steps` constant phases per period (each at the curve's mean over its step)."""
    phases, width = [], period_s / steps
    for k in range(int(math.ceil(duration_s / width))):
        a, b = 2 * math.pi * k * width / period_s, 2 * math.pi * (k + 1) * width / period_s
        mean_cos = (math.sin(b) - math.sin(a)) / (b - a)  # the mean of cos over the step
        level = low + (peak - low) * (1 - mean_cos) / 2
        phases.append(LoadPhase(k * width, base_rate * level, prompt, output,
                                f"sinusoid {low:g}x <-> {peak:g}x, period {period_s:.0f}s" if k == 0 else ""))
    return phases


def sinusoid() -> "Scenario":
    from stallfree.simulator.closed_loop_scenarios import SCALE_OUT_OUTPUT, SCALE_OUT_PROMPT, Scenario, scale_out

    base = scale_out()
    duration = 3 * SINUSOID_PERIOD_S
    phases = sinusoid_phases(SINUSOID_BASE_RATE, SINUSOID_LOW, SINUSOID_PEAK, SINUSOID_PERIOD_S, SINUSOID_STEPS,
                             duration, parse_length(SCALE_OUT_PROMPT), parse_length(SCALE_OUT_OUTPUT))
    return Scenario(
        "sinusoid",
        f"a sinusoidal load, {SINUSOID_LOW:g}x <-> {SINUSOID_PEAK:g}x over {SINUSOID_PERIOD_S / 60:.0f} minutes (as "
        f"Dynamo #10528): goodput >= {GOODPUT_GOAL:.0%} at <= 1.15x the oracle's replica-minutes",
        replace(base.cluster, keep_records=True), base.policy, phases, duration_s=duration,
        load_changes=2 * int(duration / SINUSOID_PERIOD_S))  # one rise and one fall per period


def goodput(records: Sequence[Any], slo, unfinished: int = 0) -> float | None:
    """The share of requests that met every SLO (TTFT, TPOT, queue wait); requests never finished count as missed."""
    total = len(records) + unfinished
    if not total:
        return None
    met = sum(1 for r in records
              if within_targets(_ms(r.ttft_s), _ms(r.tpot_s), _ms(r.queue_wait_s), ttft_target_ms=slo.ttft_p99_ms,
                                tpot_target_ms=slo.tpot_p99_ms, queue_wait_target_ms=slo.queue_wait_p99_ms))
    return met / total


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def summarize_sinusoid(scenario: "Scenario", run: ClosedLoopRun) -> tuple[dict[str, Any], dict[str, bool]]:
    rows = timeline(run)
    share = goodput(run.records, scenario.policy.slo, max(0, run.submitted - len(run.records)))
    trusted = sum(1 for r in rows if r.get("forecast_trusted"))
    errors = [r["forecast_error"] for r in rows if r.get("forecast_error") is not None]
    summary = {
        "requests_submitted": run.submitted,
        "requests_finished": len(run.records),
        "goodput": None if share is None else round(share, 4),
        "replicas_max": max((s.scale.desired for s in run.steps), default=None),
        "replicas_min": min((s.scale.desired for s in run.steps), default=None),
        "steps_with_the_forecast_trusted": f"{trusted} of {len(rows)}",
        "forecast_error_median": sorted(errors)[len(errors) // 2] if errors else None,
        "scenario_goals": {f"goodput_at_least_{GOODPUT_GOAL:.0%}": share is not None and share >= GOODPUT_GOAL},
    }
    return summary, {"requests_served": bool(run.records)}


def summarize_ramp(scenario: "Scenario", run: ClosedLoopRun) -> tuple[dict[str, Any], dict[str, bool]]:
    """Windows while the load climbs, from when the start's backlog was drained and left the p99 window."""
    rows = timeline(run)
    slo = scenario.policy.slo
    limits = {col: getattr(slo, key) for _, col, key, _ in SLOS}
    first_breach = min((r["t"] for r in rows for col, limit in limits.items()
                        if r[col] is not None and r[col] > limit), default=None)
    climb_end = max(p.start_s for p in scenario.phases)
    drained = None if first_breach is None else _drained_at(rows, first_breach)
    clear = None if drained is None else drained + scenario.policy.window_s
    judged = [r for r in rows if clear is not None and clear <= r["t"] <= climb_end]
    over = [(r["t"], col) for r in judged for col, limit in limits.items() if r[col] is not None and r[col] > limit]
    changes = [(s.time, s.scale.current, s.scale.desired) for s in run.steps if s.scale.changed]
    ok = first_breach is None or (clear is not None and not over)
    summary = {
        "start_backlog_breach_s": first_breach,
        "start_backlog_drained_s": drained,
        "judged_from_s": clear,
        "climb_ends_s": climb_end,
        "windows_judged_while_climbing": len(judged),
        "windows_over_an_slo_while_climbing": [{"t": t, "p99": col} for t, col in over[:8]],
        "scale_changes": [{"t": t, "from": c, "to": n} for t, c, n in changes],
        "replicas_max": max((s.scale.desired for s in run.steps), default=None),
        "scenario_goals": {"no_window_over_slo_while_climbing_once_start_drained": ok},
    }
    return summary, {"scaled_up_for_the_load": any(n > c for _, c, n in changes)}
