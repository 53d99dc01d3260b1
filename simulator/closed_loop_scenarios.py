"""The closed-loop scenarios `stallfree control --scenario NAME` runs, and the figures each must show.

Every scenario is a virtual cluster (model shape on a GPU preset, cost-model time), an InferenceService
policy (SLOs, bounds, scaling windows) and a load that changes at known times. Each result carries the
whole timeline and a summary of the figures its claim rests on; `check` says whether they hold.

- tpot-step: long prompts join a chat load on one replica; p99 TPOT breaches, the tuner lowers the
  budget; back under the SLO within 3 intervals, at most one reversal of direction.
- small-budget: a replica started with a budget far too small under prompt-heavy load; the tuner raises
  it, p99 TTFT improves at least 2x while p99 TPOT stays under its SLO.
- scale-out: demand of about 3 replicas' prefill capacity for 13 minutes, then about 1.1; scale-out
  reaches demand / capacity (within one replica), plus the replicas busy draining their own backlog,
  within two scaling windows, scale-in waits out the
  stabilization window, no flapping over 30 minutes.
- unknown-replica: one of two replicas cannot be read; no scaling decision rests on it and the status
  says so; when load rises, the scale-up is sized from the readable replica alone.
- burst: 10x the demand for 60 s, then back; ramp: demand doubling over 10 minutes (its goal and the
  sinusoid scenario: closed_loop_scenarios_predictable.py).
- A profile that can be wrong (speed.py): slow (every replica at x0.7 the speed its profile says), fast
  (x1.4), neighbour (x1.0, then x0.6 from t=600 s: a noisy neighbour) and mixed-fleet (a100 and h100
  replicas in one service). The controller reads each replica's profile and learns the truth from its
  windows; the oracle knows it.

Every scenario must meet every goal (closed_loop_judge.py); `ok` is its checks and its goals together, so
`stallfree control --scenario all` exits non-zero when any scenario misses any goal.

Every scenario is also judged on every SLO it declares (closed_loop_judge.py: windows within, restore
times after the replicas are ready, reversals) and set against an offline oracle (closed_loop_oracle.py:
the fewest replicas meeting every SLO, knowing the future): replica-minutes over the oracle's.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from stallfree.contracts import Ceilings, Tuning
from stallfree.simulator.virtual_replica import VirtualReplica
from stallfree.simulator.workload import parse_length
from stallfree.simulator.closed_loop import ClosedLoopRun, ClusterSpec, LoadPhase, poisson_arrivals, run_closed_loop
from stallfree.simulator.speed import SpeedSchedule
from stallfree.simulator.closed_loop_judge import OVER_ORACLE, judge
from stallfree.simulator.closed_loop_oracle import oracle
from stallfree.simulator import closed_loop_scenarios_objectives as objective_scenarios
from stallfree.simulator import closed_loop_scenarios_predictable as predictable
from stallfree.operator.control.loop import counts_as_known
from stallfree.operator.control.policy import ControlPolicy, ScalingPolicy, SLOTargets, drain_target_s
from stallfree.operator.control.scaler import SCALED_DOWN, SCALED_UP
from stallfree.operator.control.timeline import budget_reversals, timeline


@dataclass(frozen=True)
class Scenario:
    name: str
    claim: str
    cluster: ClusterSpec
    policy: ControlPolicy
    phases: list[LoadPhase]
    duration_s: float
    replicas: int = 1
    unreadable: tuple[str, ...] = ()
    seed: int = 0
    load_changes: int | None = None  # how many load changes the reversal goal allows (default: phases - 1)


@dataclass
class ScenarioResult:
    scenario: Scenario
    run: ClosedLoopRun
    summary: dict[str, Any]
    checks: dict[str, bool] = field(default_factory=dict)
    judged: dict[str, Any] = field(default_factory=dict)
    oracle: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Its own checks and every goal (no goal is excused: a missed one fails the run)."""
        return all(self.checks.values()) and all(self.judged.get("goals", {}).values())

    @property
    def missed(self) -> list[str]:
        return [f"check {k}" for k, v in self.checks.items() if not v] + \
            [f"goal {k}" for k, v in self.judged.get("goals", {}).items() if not v]

    def to_dict(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "scenario": s.name,
            "claim": s.claim,
            "model": s.cluster.model,
            "hardware": s.cluster.hardware,
            "slo": {"ttft_p99_ms": s.policy.slo.ttft_p99_ms, "tpot_p99_ms": s.policy.slo.tpot_p99_ms,
                    "queue_wait_p99_ms": s.policy.slo.queue_wait_p99_ms},
            "interval_s": s.policy.interval_s,
            "window_s": s.policy.window_s,
            "load": [{"start_s": p.start_s, "rate": p.rate, "prompt_len": p.prompt_len.describe(),
                      "output_len": p.output_len.describe(), "label": p.label} for p in s.phases],
            "summary": self.summary,
            "checks": self.checks,
            "ok": self.ok,
            "missed": self.missed,
            "replica_minutes": self.judged.get("replica_minutes"),
            "replica_minutes_over_oracle": self.oracle.get("replica_minutes_over_oracle"),
            "slo_window_fraction": self.judged.get("slo_window_fraction"),
            "judged": self.judged,
            "oracle": self.oracle,
            "requests_submitted": self.run.submitted,
            "timeline": timeline(self.run),
            "events": self.run.events,
        }


# --- tpot-step ---------------------------------------------------------------------------------------

def tpot_step() -> Scenario:
    chat_prompt, output = parse_length("uniform:256:768"), parse_length("uniform:128:512")
    return Scenario(
        "tpot-step",
        "a step up in long-prompt load on one replica: p99 TPOT back under its SLO within 3 control intervals, "
        "at most one reversal of direction",
        ClusterSpec("mistral-7b", "a100", ceilings=Ceilings(4096, 256), start_tuning=Tuning(512, 64),
                    max_model_len=32768),
        ControlPolicy(slo=SLOTargets(ttft_p99_ms=10000, tpot_p99_ms=40, queue_wait_p99_ms=5000),
                      scaling=ScalingPolicy(min_replicas=1, max_replicas=1), interval_s=10, window_s=10),
        [LoadPhase(0, 3.0, chat_prompt, output, "chat"),
         LoadPhase(60, 3.3, parse_length("mix:3*uniform:256:768|0.3*uniform:20000:28000"), output,
                   "chat + long documents (20-28k tokens)")],
        duration_s=300,
    )


def summarize_tpot_step(scenario: Scenario, run: ClosedLoopRun) -> tuple[dict[str, Any], dict[str, bool]]:
    slo, step_s = scenario.policy.slo.tpot_p99_ms, scenario.phases[1].start_s
    rows = [(s.time, s.observed_p99()["tpot_ms"]) for s in run.steps]
    before = [v for t, v in rows if t <= step_s and v is not None]
    breach = next((t for t, v in rows if t > step_s and v is not None and v > slo), None)
    recovered = None if breach is None else next((t for t, v in rows if t > breach and v is not None and v <= slo), None)
    intervals = None if recovered is None else round((recovered - breach) / scenario.policy.interval_s)
    after = [v for t, v in rows if recovered is not None and t >= recovered and v is not None]
    budgets = _budgets(run)
    summary = {
        "step_s": step_s,
        "tpot_slo_ms": slo,
        "p99_tpot_before_step_ms": max(before) if before else None,
        "first_breach_s": breach,
        "p99_tpot_at_breach_ms": dict(rows).get(breach),
        "back_under_slo_s": recovered,
        "intervals_to_recover": intervals,
        "p99_tpot_after_recovery_max_ms": max(after) if after else None,
        "steps_over_slo_after_recovery": sum(1 for v in after if v > slo),
        "budget_start": budgets[0] if budgets else None,
        "budget_end": budgets[-1] if budgets else None,
        "reversals": budget_reversals(run),
    }
    checks = {
        "tpot_breached_after_step": breach is not None,
        "back_under_slo_within_3_intervals": intervals is not None and intervals <= 3,
        "at_most_one_reversal": summary["reversals"] <= 1,
    }
    return summary, checks


# --- small-budget ------------------------------------------------------------------------------------

def small_budget() -> Scenario:
    return Scenario(
        "small-budget",
        "a budget started far too small under prompt-heavy load: the tuner raises it, p99 TTFT improves at least "
        "2x while p99 TPOT stays under its SLO",
        ClusterSpec("mistral-7b", "a100", ceilings=Ceilings(4096, 256), start_tuning=Tuning(64, 32),
                    max_model_len=8192),
        ControlPolicy(slo=SLOTargets(ttft_p99_ms=2000, tpot_p99_ms=40, queue_wait_p99_ms=1000),
                      scaling=ScalingPolicy(min_replicas=1, max_replicas=1), interval_s=10, window_s=10,
                      initial_token_budget=64),
        [LoadPhase(0, 4.0, parse_length("uniform:1024:3072"), parse_length("uniform:32:128"),
                   "prompt-heavy: 2k-token prompts, short answers")],
        duration_s=180,
    )


def summarize_small_budget(scenario: Scenario, run: ClosedLoopRun,
                           baseline: ClosedLoopRun | None = None) -> tuple[dict[str, Any], dict[str, bool]]:
    slo = scenario.policy.slo
    ttft = [s.observed_p99()["ttft_ms"] for s in run.steps]
    tpot = [s.observed_p99()["tpot_ms"] for s in run.steps]
    first = ttft[0]
    last_minute = _last(ttft, scenario.policy.interval_s)
    budgets = _budgets(run)
    summary: dict[str, Any] = {
        "budget_start": budgets[0] if budgets else None,
        "budget_end": budgets[-1] if budgets else None,
        "raises": sum(1 for s in run.steps for d in s.tuning if d.kind == "budget_raised"),
        "p99_ttft_first_window_ms": first,
        "p99_ttft_last_minute_mean_ms": last_minute,
        "ttft_improvement": (first / last_minute) if first and last_minute else None,
        "p99_tpot_max_ms": max(v for v in tpot if v is not None),
        "tpot_slo_ms": slo.tpot_p99_ms,
    }
    if baseline is not None:
        fixed = _last([s.observed_p99()["ttft_ms"] for s in baseline.steps], scenario.policy.interval_s)
        summary["baseline_fixed_budget_p99_ttft_last_minute_ms"] = fixed
        summary["improvement_over_fixed_budget"] = (fixed / last_minute) if fixed and last_minute else None
    checks = {
        "budget_raised": bool(budgets) and budgets[-1] > budgets[0],
        "ttft_improved_2x": summary["ttft_improvement"] is not None and summary["ttft_improvement"] >= 2.0,
        "tpot_under_slo_throughout": summary["p99_tpot_max_ms"] <= slo.tpot_p99_ms,
    }
    return summary, checks


# --- scale-out ---------------------------------------------------------------------------------------

SCALE_OUT_PROMPT, SCALE_OUT_OUTPUT = "uniform:2048:4096", "uniform:32:96"


def scale_out() -> Scenario:
    prompt, output = parse_length(SCALE_OUT_PROMPT), parse_length(SCALE_OUT_OUTPUT)
    return Scenario(
        "scale-out",
        "demand beyond one replica's prefill capacity: scale-out reaches demand/capacity (within one replica) plus the "
        "replicas busy draining their own backlog, in at most two scaling windows; scale-in waits out the stabilization window; no flapping over 30 minutes",
        ClusterSpec("llama-3-70b", "h200", dtype="fp8", ceilings=Ceilings(2048, 256), start_tuning=Tuning(512, 128),
                    max_model_len=8192, startup_s=20),
        ControlPolicy(slo=SLOTargets(ttft_p99_ms=3000, tpot_p99_ms=100, queue_wait_p99_ms=2000),
                      scaling=ScalingPolicy(min_replicas=1, max_replicas=8, scale_up_stabilization_s=30,
                                            scale_down_stabilization_s=300, drain_target_s=drain_target_s(2000)),
                      interval_s=10, window_s=30),
        [LoadPhase(0, 0.6, prompt, output, "light"),
         LoadPhase(120, 4.1, prompt, output, "beyond one replica's prefill capacity"),
         LoadPhase(900, 1.45, prompt, output, "load drops")],
        duration_s=1800,
    )


def measured_capacity(scenario: Scenario, tuning: Tuning, seconds: float = 60.0) -> float:
    """Prefill tokens/s one replica sustains at `tuning` when saturated with the scenario's own requests."""
    spec = scenario.cluster
    replica = VirtualReplica.for_model(spec.model, spec.hardware, tuning=tuning, ceilings=spec.ceilings,
                                       max_model_len=spec.max_model_len, dtype=spec.dtype,
                                       stats_window_s=seconds / 2)
    phase = max(scenario.phases, key=lambda p: p.rate)
    overload = replace(phase, rate=phase.rate * 2)
    for arrival, prompt_len, max_tokens in poisson_arrivals(overload, 0.0, seconds, random.Random(scenario.seed + 1)):
        replica.submit(prompt_len, max_tokens, arrival)
    replica.advance_to(seconds)
    return replica.window_stats(seconds).prefill_tokens_per_s


def summarize_scale_out(scenario: Scenario, run: ClosedLoopRun) -> tuple[dict[str, Any], dict[str, bool]]:
    policy, phases = scenario.policy, scenario.phases
    high, low = phases[1], phases[2]
    changes = [(s.time, s.scale.current, s.scale.desired) for s in run.steps if s.scale.changed]
    ups = [c for c in changes if c[2] > c[1]]
    downs = [c for c in changes if c[2] < c[1]]
    in_high = [s for s in run.steps if high.start_s < s.time <= low.start_s]
    final_high = in_high[-1].scale.desired if in_high else None
    settled = next((s for s in reversed(run.steps) if s.time <= low.start_s and s.tuning), None)
    tuning = _median_tuning(settled) if settled else scenario.cluster.start_tuning
    capacity = measured_capacity(scenario, tuning)
    demand = high.rate * _mean_length(high.prompt_len)
    target = demand / capacity if capacity else None
    # The count the high load settled at, first reached (a drained burst's surplus may step down to it later).
    reached = next((t for t, _, n in changes if n >= final_high), None) if final_high else None
    # Replicas sized in beside the demand because their own queue drains only through them (scaler.py).
    busy = max((s.scale.busy_replicas for s in run.steps if s.scale.kind == SCALED_UP), default=0)
    window = policy.scaling.scale_up_stabilization_s
    directions = [1 if n > c else -1 for _, c, n in changes]  # consecutive steps down are one direction
    reversals = sum(1 for a, b in zip(directions, directions[1:]) if a != b)
    # Scale-in after the load drop (steps down while the high load lasts shed a drained backlog's surplus).
    first_down = next((t for t, c, n in downs if t > low.start_s), None)
    summary = {
        "demand_prompt_tokens_per_s": round(demand),
        "measured_capacity_per_replica_tokens_per_s": round(capacity),
        "settled_token_budget": tuning.token_budget,
        "demand_over_capacity": round(target, 2) if target else None,
        "replicas_during_high_load": final_high,
        "busy_draining_replicas_sized_in": busy,
        "scale_ups": [{"t": t, "from": c, "to": n} for t, c, n in ups],
        "scale_downs": [{"t": t, "from": c, "to": n} for t, c, n in downs],
        "load_step_s": high.start_s,
        "reached_final_count_s": reached,
        "scaling_windows_to_reach": round((reached - high.start_s) / window, 2) if reached else None,
        "scale_up_decisions": len(ups),
        "load_drop_s": low.start_s,
        "first_scale_in_s": first_down,
        "scale_in_delay_s": (first_down - low.start_s) if first_down else None,
        "scale_down_stabilization_s": policy.scaling.scale_down_stabilization_s,
        "replicas_after_drop": run.steps[-1].scale.desired,
        "direction_reversals": reversals,
    }
    checks = {
        "reaches_demand_over_capacity_within_one": target is not None and final_high is not None
        and abs(final_high - busy - target) <= 1.0,
        "within_two_scaling_windows": len(ups) <= 2 and reached is not None and reached - high.start_s <= 2 * window
        + policy.window_s + policy.interval_s,
        "scale_in_waits_out_window": first_down is not None
        and first_down - low.start_s >= policy.scaling.scale_down_stabilization_s,
        "no_flapping": reversals <= 1,
    }
    return summary, checks


# --- unknown-replica ---------------------------------------------------------------------------------

def unknown_replica() -> Scenario:
    prompt, output = parse_length(SCALE_OUT_PROMPT), parse_length(SCALE_OUT_OUTPUT)
    base = scale_out()
    return Scenario(
        "unknown-replica",
        "a replica whose stats cannot be read: no scaling decision rests on it, and status says so",
        base.cluster,
        base.policy,
        [LoadPhase(0, 1.2, prompt, output, "light: would fit one replica"),
         LoadPhase(600, 5.0, prompt, output, "beyond the readable replica's capacity")],
        duration_s=900,
        replicas=2,
        unreadable=("r1",),
    )


def summarize_unknown_replica(scenario: Scenario, run: ClosedLoopRun) -> tuple[dict[str, Any], dict[str, bool]]:
    name = scenario.unreadable[0]
    steps = run.steps
    unknown_steps = sum(1 for s in steps if any(o.name == name and not o.known for o in s.observations))
    downs = [s for s in steps if s.scale.kind == SCALED_DOWN]
    ups = [s for s in steps if s.scale.kind == SCALED_UP]
    # Every decision's demand must be the readable replicas' alone.
    rests_on_known_only = all(
        s.scale.demand_tokens_per_s is None or math.isclose(
            s.scale.demand_tokens_per_s,
            sum(o.stats.prompt_tokens_per_s for o in s.observations if counts_as_known(o)),
            rel_tol=1e-9, abs_tol=1e-6)
        for s in steps)
    quiet = [s for s in steps if s.time <= scenario.phases[1].start_s]
    status = steps[-1].to_status()
    conditions = {c.type: c.status for c in steps[-1].conditions}
    summary = {
        "unreadable_replica": name,
        "steps": len(steps),
        "steps_with_it_unknown": unknown_steps,
        "scale_downs": len(downs),
        "scale_in_held_steps_during_light_load": sum(1 for s in quiet if s.scale.reason == "scale_in_blocked"),
        "scale_ups": [{"t": s.time, "from": s.scale.current, "to": s.scale.desired, "message": s.scale.message}
                      for s in ups],
        "status_unknown_replicas": status["unknownReplicas"],
        "conditions": conditions,
    }
    checks = {
        "replica_unknown_every_step": unknown_steps == len(steps),
        "no_scale_in_from_unknown": not downs,
        "decisions_rest_on_known_only": rests_on_known_only,
        "status_names_it": any(u["name"] == name for u in status["unknownReplicas"]),
        "slo_condition_not_true": conditions.get("SLOMet") != "True",
    }
    return summary, checks


# --- burst and ramp ----------------------------------------------------------------------------------

def burst() -> Scenario:
    prompt, output = parse_length(SCALE_OUT_PROMPT), parse_length(SCALE_OUT_OUTPUT)
    base = scale_out()
    return Scenario(
        "burst",
        "10x the demand for 60 s, then back: every SLO judged against an oracle that knew the burst was coming",
        base.cluster, base.policy,
        [LoadPhase(0, 0.7, prompt, output, "steady"),
         LoadPhase(300, 7.0, prompt, output, "burst: 10x for 60 s"),
         LoadPhase(360, 0.7, prompt, output, "back to steady")],
        duration_s=1200,
    )


def ramp() -> Scenario:
    prompt, output = parse_length(SCALE_OUT_PROMPT), parse_length(SCALE_OUT_OUTPUT)
    base = scale_out()
    start, seconds, steps, rate = 120.0, 600.0, 20, 2.5
    phases = [LoadPhase(0, rate, prompt, output, "steady")]
    phases += [LoadPhase(start + k * seconds / steps, rate * 2 ** (k / steps), prompt, output,
                         "ramp: demand doubling over 10 min" if k == 1 else "") for k in range(1, steps + 1)]
    return Scenario(
        "ramp",
        "demand doubling over 10 minutes: replicas follow it without flapping, every SLO judged against an oracle",
        base.cluster, base.policy, phases, duration_s=1200, load_changes=1,
    )


def wrong_profile(name: str, claim: str, speed: SpeedSchedule = SpeedSchedule(),
                  hardware_mix: tuple[str, ...] = ()) -> Scenario:
    """scale-out's service and load (light, beyond one replica, drop) on replicas whose truth differs
    from the profile the loop reads."""
    base = scale_out()
    return Scenario(name, claim, replace(base.cluster, speed=speed, hardware_mix=hardware_mix), base.policy,
                    base.phases, base.duration_s)


def slow() -> Scenario:
    return wrong_profile("slow", "every replica at x0.7 the speed its profile says: the loop learns it from its "
                         "windows and meets the same goals", SpeedSchedule(0.7))


def fast() -> Scenario:
    return wrong_profile("fast", "every replica at x1.4 the speed its profile says: no replica-minutes wasted on a "
                         "pessimistic profile", SpeedSchedule(1.4))


def neighbour() -> Scenario:
    return wrong_profile("neighbour", "a noisy neighbour: every replica slows to x0.6 at t=600 s, mid-load",
                         SpeedSchedule(1.0, change_at_s=600, factor_after=0.6))


def mixed_fleet() -> Scenario:
    """Mistral-7B on alternating a100 and h100 replicas (about 12k and 26k prompt tok/s each at budget 512):
    each is routed and counted at its own speed; a new replica's speed is not known before it is ready."""
    prompt, output = parse_length(SCALE_OUT_PROMPT), parse_length(SCALE_OUT_OUTPUT)
    base = scale_out()
    return Scenario(
        "mixed-fleet", "a100 and h100 replicas in one service: each routed and counted at its own speed",
        replace(base.cluster, model="mistral-7b", dtype="bfloat16", hardware="a100", hardware_mix=("a100", "h100")),
        base.policy,
        [LoadPhase(0, 2.0, prompt, output, "light"),
         LoadPhase(120, 16.0, prompt, output, "beyond two replicas' prefill capacity"),
         LoadPhase(900, 6.0, prompt, output, "load drops")],
        duration_s=1800,
    )


def summarize_load_change(scenario: Scenario, run: ClosedLoopRun) -> tuple[dict[str, Any], dict[str, bool]]:
    changes = [(s.time, s.scale.current, s.scale.desired) for s in run.steps if s.scale.changed]
    summary = {"scale_changes": [{"t": t, "from": c, "to": n} for t, c, n in changes],
               "replicas_max": max((s.scale.desired for s in run.steps), default=None),
               "replicas_end": run.steps[-1].scale.desired if run.steps else None}
    return summary, {"scaled_up_for_the_load": any(n > c for _, c, n in changes)}


# --- running -----------------------------------------------------------------------------------------

SCENARIOS: dict[str, tuple[Callable[[], Scenario], Callable[..., tuple[dict[str, Any], dict[str, bool]]]]] = {
    "tpot-step": (tpot_step, summarize_tpot_step),
    "small-budget": (small_budget, summarize_small_budget),
    "scale-out": (scale_out, summarize_scale_out),
    "unknown-replica": (unknown_replica, summarize_unknown_replica),
    "burst": (burst, summarize_load_change),
    "ramp": (ramp, predictable.summarize_ramp),
    "slow": (slow, summarize_load_change),
    "fast": (fast, summarize_load_change),
    "neighbour": (neighbour, summarize_load_change),
    "mixed-fleet": (mixed_fleet, summarize_load_change),
    "sinusoid": (predictable.sinusoid, predictable.summarize_sinusoid),
}
SCENARIOS.update(objective_scenarios.SCENARIOS)  # objectives and tenants: run and judged there


async def run_scenario(name: str, seed: int | None = None) -> ScenarioResult:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    if name in objective_scenarios.RUNS:
        return await objective_scenarios.run_objective_scenario(name, seed)
    build, summarize = SCENARIOS[name]
    scenario = build()
    if seed is not None:
        scenario = replace(scenario, seed=seed)
    run = await _run(scenario)
    if name == "small-budget":
        fixed = replace(scenario, policy=replace(scenario.policy, tuning_enabled=False))
        summary, checks = summarize(scenario, run, await _run(fixed))
    else:
        summary, checks = summarize(scenario, run)
    judged, reference = judge_run(scenario, run)
    judged["goals"].update(summary.pop("scenario_goals", {}))  # a scenario's own goals gate like the common ones
    return ScenarioResult(scenario, run, summary, checks, judged, reference)


def judge_run(scenario: Scenario, run: ClosedLoopRun) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every SLO judged over the run, beside the oracle's replica-minutes."""
    reference = oracle(scenario)
    slo = scenario.policy.slo
    changes = scenario.load_changes if scenario.load_changes is not None else len(scenario.phases) - 1
    judged = judge(timeline(run), {"tpot_p99_ms": slo.tpot_p99_ms, "queue_wait_p99_ms": slo.queue_wait_p99_ms,
                                   "ttft_p99_ms": slo.ttft_p99_ms}, scenario.policy.interval_s, changes,
                   reference["infeasible"], window_s=scenario.policy.window_s)
    ratio = judged["replica_minutes"] / reference["replica_minutes"] if reference["replica_minutes"] else None
    reference["replica_minutes_over_oracle"] = None if ratio is None else round(ratio, 3)
    judged["goals"]["replica_minutes_within_1.15x_oracle"] = ratio is not None and ratio <= OVER_ORACLE
    return judged, reference


async def _run(scenario: Scenario) -> ClosedLoopRun:
    return await run_closed_loop(scenario.cluster, scenario.policy, scenario.phases, scenario.duration_s,
                                 replicas=scenario.replicas, unreadable=scenario.unreadable, seed=scenario.seed)


def _budgets(run: ClosedLoopRun) -> list[int]:
    """The first replica's budget at each step (what it runs)."""
    out = []
    for step in run.steps:
        obs = next((o for o in step.observations if o.stats is not None), None)
        if obs is not None:
            out.append(obs.stats.tuning.token_budget)
    return out


def _median_tuning(step) -> Tuning:
    tunings = sorted((d.tuning for d in step.tuning if d.tuning is not None), key=lambda t: t.token_budget)
    return tunings[(len(tunings) - 1) // 2]


def _last(values: list[float | None], interval_s: float, seconds: float = 60.0) -> float | None:
    tail = [v for v in values[-max(1, int(seconds / interval_s)):] if v is not None]
    return sum(tail) / len(tail) if tail else None


def _mean_length(dist, samples: int = 20000) -> float:
    rng = random.Random(12345)
    return sum(dist.sample(rng) for _ in range(samples)) / samples
