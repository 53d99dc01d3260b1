"""Closed-loop scenarios with objectives and tenants: each request names its class and its sender.

- mixed-objectives: interactive requests at 60% of maxReplicas' prefill capacity, then a batch flood (a sheddable
  objective) at 3x that capacity, on a fleet at maxReplicas (what batch may use is then the whole fleet's spare
  capacity, the goal's measure). Goals: interactive goodput >= 99%; no batch request waits past its TTFT target
  and then fails (each is served in time or refused at arrival: none served late, lost or refused by a full
  queue); batch uses >= 90% of the prefill capacity the interactive load leaves over the flood.
- tenants: four tenants share the service at 60% of its capacity; a fifth floods at 3x. Run again without the
  flood: every other tenant's p99 TTFT over the flood's span within 1.2x of its own without it.

The streams run side by side (one Poisson stream per objective or tenant: `ObjectivePhase`), through the
virtual router with the service's objectives (virtual_router.py: production's queue order and shedding). Their
goals are judged on each request's outcome (request_outcomes.py), not on the replicas' windows: those mix the
objectives, and a batch request's long wait in the router's queue is its objective's business, not a breach.

This module imports closed_loop_scenarios lazily (in functions): that one registers these scenarios.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from stallfree.contracts import Tuning
from stallfree.operator.control.policy import ControlPolicy, ObjectiveTargets, SLOTargets
from stallfree.operator.control.timeline import budget_reversals
from stallfree.operator.router.objectives import Objective, Objectives
from stallfree.simulator.closed_loop import (ClosedLoopDriver, ClosedLoopRun, ClusterSpec, LoadPhase, active_phase,
                                            poisson_arrivals)
from stallfree.simulator.workload import parse_length

if TYPE_CHECKING:
    from stallfree.simulator.closed_loop_scenarios import Scenario, ScenarioResult

PROMPT, OUTPUT = "uniform:2048:4096", "uniform:32:96"  # scale-out's lengths
MAX_REPLICAS = 4
INTERACTIVE_SHARE, FLOOD = 0.6, 3.0  # of maxReplicas' prefill capacity
FLOOD_START_S, FLOOD_END_S, DURATION_S = 180.0, 720.0, 900.0
# Goals.
INTERACTIVE_GOODPUT, SPARE_USED, TENANT_P99_RATIO = 0.99, 0.90, 1.2


@dataclass(frozen=True)
class ObjectivePhase(LoadPhase):
    """A LoadPhase of one stream: its requests name `objective` and `tenant`; streams run side by side."""

    objective: str = ""
    tenant: str = ""
    stream: str = ""


def streams(phases: Sequence[LoadPhase]) -> dict[str, list[LoadPhase]]:
    out: dict[str, list[LoadPhase]] = {}
    for phase in phases:
        out.setdefault(getattr(phase, "stream", ""), []).append(phase)
    return out


class StreamsDriver(ClosedLoopDriver):
    """ClosedLoopDriver whose load is several streams at once, each request labelled with its objective and tenant,
    into a router that knows the service's objectives."""

    def __init__(self, cluster_spec: ClusterSpec, policy: ControlPolicy, phases: Sequence[LoadPhase],
                 replicas: int = 1, seed: int = 0) -> None:
        super().__init__(cluster_spec, policy, phases, replicas, seed=seed)
        self.cluster.router.use_objectives(router_objectives(policy))
        # One generator per stream: a stream's arrivals do not depend on the others', so a run without the flood
        # replays the other tenants' very requests (tenants compares each with itself, not with another sample).
        self._stream_rngs = {name: random.Random(f"{seed}:{name}") for name in streams(self.phases)}

    def arrivals(self, t: float, end: float) -> list[tuple[Any, ...]]:
        """Every stream's arrivals of this interval, each labelled (objective, tenant), in time order."""
        arrivals: list[tuple[Any, ...]] = []
        for name, phases in streams(self.phases).items():
            cuts = sorted({t, end, *(p.start_s for p in phases if t < p.start_s < end)})
            for lo, hi in zip(cuts, cuts[1:]):
                phase = active_phase(phases, lo)
                if phase is not None:
                    labels = (getattr(phase, "objective", ""), getattr(phase, "tenant", ""))
                    arrivals += [(*a, *labels) for a in poisson_arrivals(phase, lo, hi, self._stream_rngs[name])]
        arrivals.sort(key=lambda a: a[0])
        return arrivals


def router_objectives(policy: ControlPolicy) -> Objectives:
    """The policy's objectives as the operator hands them to the router (`--objectives`)."""
    if not policy.objectives:
        return Objectives.implicit()
    objectives = [Objective(o.name, o.priority, o.ttft_p99_ms, o.tpot_p99_ms, o.queue_wait_p99_ms)
                  for o in policy.objectives]
    default = next((o for o, t in zip(objectives, policy.objectives) if t.default), objectives[0])
    return Objectives({o.name: o for o in objectives}, default)


async def run_streams(scenario: "Scenario") -> tuple[ClosedLoopRun, StreamsDriver]:
    driver = StreamsDriver(scenario.cluster, scenario.policy, scenario.phases, scenario.replicas, scenario.seed)
    return await driver.run(scenario.duration_s), driver


# --- the scenarios ------------------------------------------------------------------------------------

def _base() -> "Scenario":
    from stallfree.simulator.closed_loop_scenarios import scale_out

    base = scale_out()
    scaling = replace(base.policy.scaling, max_replicas=MAX_REPLICAS)
    return replace(base, policy=replace(base.policy, scaling=scaling))


def capacity_requests_per_s(scenario: "Scenario", tuning: Tuning) -> float:
    """One replica's prefill capacity in requests/s of these lengths (closed_loop_scenarios.measured_capacity)."""
    from stallfree.simulator.closed_loop_scenarios import _mean_length, measured_capacity

    probe = replace(scenario, phases=[LoadPhase(0, 2.0, parse_length(PROMPT), parse_length(OUTPUT))])
    return measured_capacity(probe, tuning) / _mean_length(parse_length(PROMPT))


# The nominal capacity the loads are set from (one replica at the start tuning, measured once per process).
_NOMINAL: dict[str, float] = {}


def _nominal_rate(scenario: "Scenario") -> float:
    key = scenario.cluster.model + scenario.cluster.hardware
    if key not in _NOMINAL:
        _NOMINAL[key] = capacity_requests_per_s(scenario, scenario.cluster.start_tuning)
    return _NOMINAL[key]


def mixed_objectives() -> "Scenario":
    base = _base()
    prompt, output = parse_length(PROMPT), parse_length(OUTPUT)
    slo = base.policy.slo
    objectives = (ObjectiveTargets("interactive", 0, slo.ttft_p99_ms, slo.tpot_p99_ms, slo.queue_wait_p99_ms,
                                   default=True),
                  ObjectiveTargets("batch", -1, 30000.0, slo.tpot_p99_ms, 30000.0))
    policy = replace(base.policy, objectives=objectives)
    full = MAX_REPLICAS * _nominal_rate(base)
    phases: list[LoadPhase] = [
        ObjectivePhase(0, INTERACTIVE_SHARE * full, prompt, output, "interactive: 60% of maxReplicas' capacity",
                       objective="interactive", stream="interactive"),
        ObjectivePhase(0, 0.0, prompt, output, "", objective="batch", stream="batch"),
        ObjectivePhase(FLOOD_START_S, FLOOD * full, prompt, output, "batch flood: 3x maxReplicas' capacity",
                       objective="batch", stream="batch"),
        ObjectivePhase(FLOOD_END_S, 0.0, prompt, output, "flood ends", objective="batch", stream="batch")]
    from stallfree.simulator.closed_loop_scenarios import Scenario

    return Scenario("mixed-objectives", "interactive at 60% of capacity beside a batch flood at 3x (sheddable), "
                    f"maxReplicas {MAX_REPLICAS}: interactive goodput >= 99%, batch served in time or refused at "
                    "arrival, batch fills >= 90% of the spare prefill capacity",
                    base.cluster, policy, phases, DURATION_S, replicas=MAX_REPLICAS, load_changes=2)


TENANTS = ("t1", "t2", "t3", "t4")


def tenants(flood: bool = True) -> "Scenario":
    base = _base()
    prompt, output = parse_length(PROMPT), parse_length(OUTPUT)
    # A fixed fleet at maxReplicas: the flood cannot buy the others replicas, only the router's turns protect them.
    # A tight queue-wait target keeps what a replica holds short (flow control dispatches within a quarter of it).
    slo = SLOTargets(ttft_p99_ms=3000, tpot_p99_ms=100, queue_wait_p99_ms=500)
    scaling = replace(base.policy.scaling, min_replicas=MAX_REPLICAS, max_replicas=MAX_REPLICAS)
    policy = replace(base.policy, slo=slo, scaling=scaling,
                     objectives=(ObjectiveTargets("interactive", 0, 3000.0, 100.0, 500.0, default=True),))
    full = MAX_REPLICAS * _nominal_rate(base)
    phases: list[LoadPhase] = [
        ObjectivePhase(0, INTERACTIVE_SHARE * full / len(TENANTS), prompt, output, f"tenant {t}: 15% of capacity",
                       objective="interactive", tenant=t, stream=t) for t in TENANTS]
    phases += [ObjectivePhase(0, 0.0, prompt, output, "", objective="interactive", tenant="flood", stream="flood"),
               ObjectivePhase(FLOOD_START_S, FLOOD * full if flood else 0.0, prompt, output,
                              "tenant flood: 3x capacity" if flood else "no flood (the reference run)",
                              objective="interactive", tenant="flood", stream="flood"),
               ObjectivePhase(FLOOD_END_S, 0.0, prompt, output, "flood ends", objective="interactive", tenant="flood",
                              stream="flood")]
    from stallfree.simulator.closed_loop_scenarios import Scenario

    return Scenario("tenants" if flood else "tenants-reference",
                    "one tenant floods at 3x capacity beside four at 60%: each other tenant's p99 TTFT within 1.2x of "
                    "its own without the flood", base.cluster, policy, phases, DURATION_S, replicas=MAX_REPLICAS,
                    load_changes=2)


# --- judging ------------------------------------------------------------------------------------------

def spare_prefill_used(batch_tokens: float, interactive_tokens: float, capacity_tokens_per_s: float,
                       replica_seconds: float) -> float | None:
    """The share of the prefill capacity the interactive load left that batch used (None: nothing was left)."""
    spare = capacity_tokens_per_s * replica_seconds - interactive_tokens
    return batch_tokens / spare if spare > 0 else None


def judge_mixed(summary: dict[str, Any], spare_used: float | None) -> dict[str, bool]:
    interactive, batch = summary.get("interactive", {}), summary.get("batch", {})
    return {
        "interactive_goodput_at_least_99pct": interactive.get("goodput", 0.0) >= INTERACTIVE_GOODPUT,
        "no_batch_request_waits_past_its_deadline_then_fails": bool(batch) and batch["served_late"] == 0
        and batch["lost"] == 0 and batch["refused"] == 0,
        "batch_uses_at_least_90pct_of_spare_prefill": spare_used is not None and spare_used >= SPARE_USED,
    }


def judge_tenants(flooded: dict[str, float | None], reference: dict[str, float | None],
                  others_not_served: int = 0) -> dict[str, bool]:
    """Each tenant's p99 TTFT with the flood within TENANT_P99_RATIO of its own without it, and every one of their
    requests served (a p99 over the served alone would hide the ones the flood got refused)."""
    goals = {f"tenant_{t}_p99_ttft_within_1.2x_of_no_flood": flooded.get(t) is not None and bool(reference.get(t))
             and flooded[t] <= TENANT_P99_RATIO * reference[t]  # type: ignore[operator]
             for t in sorted(reference)}
    goals["every_other_tenants_request_served"] = others_not_served == 0
    return goals


def _ready_replica_seconds(run: ClosedLoopRun, start_s: float, end_s: float) -> float:
    interval = run.policy.interval_s
    return sum(interval * sum(1 for o in s.observations if o.ready) for s in run.steps if start_s < s.time <= end_s)


def _settled_tuning(run: ClosedLoopRun, before_s: float, fallback: Tuning) -> Tuning:
    """The median budget the replicas ran at the last step before `before_s`."""
    step = next((s for s in reversed(run.steps) if s.time <= before_s and any(o.stats for o in s.observations)), None)
    if step is None:
        return fallback
    tunings = sorted((o.stats.tuning for o in step.observations if o.stats is not None), key=lambda t: t.token_budget)
    return tunings[(len(tunings) - 1) // 2]


def _run_facts(run: ClosedLoopRun) -> dict[str, Any]:
    changes = [(s.time, s.scale.current, s.scale.desired) for s in run.steps if s.scale.changed]
    return {"scale_changes": [{"t": t, "from": c, "to": n} for t, c, n in changes],
            "replicas_max": max((s.scale.desired for s in run.steps), default=None),
            "budget_reversals": budget_reversals(run)}


def _judged(run: ClosedLoopRun, goals: dict[str, bool], load_changes: int) -> dict[str, Any]:
    """What the CLI's table reads (closed_loop_judge.format_table) and the goals; no replica-window SLO rows: the
    windows mix the objectives, the goals judge each request against its own."""
    interval = run.policy.interval_s
    replica_minutes = sum(interval * sum(1 for o in s.observations if o.ready) for s in run.steps) / 60.0
    counts = [s.scale.desired for s in run.steps]
    directions = [1 if b > a else -1 for a, b in zip(counts, counts[1:]) if b != a]
    return {"slos": {}, "replica_minutes": round(replica_minutes, 1),
            "replica_reversals": sum(1 for a, b in zip(directions, directions[1:]) if a != b),
            "budget_reversals": budget_reversals(run), "load_changes": load_changes, "goals": goals}


async def run_mixed_objectives(scenario: "Scenario") -> "ScenarioResult":
    from stallfree.simulator.closed_loop_scenarios import ScenarioResult

    run, driver = await run_streams(scenario)
    outcomes = driver.cluster.router.outcomes
    whole = outcomes.summary()
    flood = outcomes.summary(FLOOD_START_S + scenario.policy.window_s, FLOOD_END_S)
    tuning = _settled_tuning(run, FLOOD_END_S, scenario.cluster.start_tuning)
    from stallfree.simulator.closed_loop_scenarios import _mean_length

    capacity = capacity_requests_per_s(scenario, tuning) * _mean_length(parse_length(PROMPT))
    # Over the flood, once the stats window has seen it: tokens of requests that arrived then and were served.
    start, end = FLOOD_START_S + scenario.policy.window_s, FLOOD_END_S
    served = {name: figures["prefill_tokens_served"] for name, figures in flood.items()}
    spare = spare_prefill_used(served.get("batch", 0), served.get("interactive", 0), capacity,
                               _ready_replica_seconds(run, start, end))
    goals = judge_mixed(whole, spare)
    summary = {"goodput": {name: f["goodput"] for name, f in whole.items()}, "by_objective": whole,
               "over_the_flood": flood, "capacity_per_replica_tokens_per_s": round(capacity),
               "settled_token_budget": tuning.token_budget,
               "batch_share_of_spare_prefill": None if spare is None else round(spare, 3), **_run_facts(run)}
    return ScenarioResult(scenario, run, summary, {}, _judged(run, goals, scenario.load_changes or 0), {})


async def run_tenants(scenario: "Scenario") -> "ScenarioResult":
    from stallfree.simulator.closed_loop_scenarios import ScenarioResult

    reference_scenario = replace(tenants(flood=False), seed=scenario.seed)
    run, driver = await run_streams(scenario)
    reference_run, reference_driver = await run_streams(reference_scenario)

    def p99s(d: StreamsDriver) -> dict[str, float | None]:
        out = {}
        for t in TENANTS:
            figures = d.cluster.router.outcomes.summary(FLOOD_START_S, FLOOD_END_S, tenant=t)
            out[t] = figures.get("interactive", {}).get("p99_ttft_ms")
        return out

    flooded, reference = p99s(driver), p99s(reference_driver)
    others = [driver.cluster.router.outcomes.summary(FLOOD_START_S, FLOOD_END_S, tenant=t).get("interactive", {})
              for t in TENANTS]
    not_served = sum(f.get("requests", 0) - f.get("served", 0) for f in others)
    goals = judge_tenants(flooded, reference, not_served)
    whole = driver.cluster.router.outcomes.summary()
    summary = {"goodput": {name: f["goodput"] for name, f in whole.items()},
               "p99_ttft_ms_with_flood": flooded, "p99_ttft_ms_without_flood": reference,
               "ratio": {t: None if not reference[t] or flooded[t] is None else round(flooded[t] / reference[t], 3)
                         for t in TENANTS},
               "other_tenants_not_served": not_served,
               "flood_tenant": driver.cluster.router.outcomes.summary(FLOOD_START_S, FLOOD_END_S, tenant="flood"),
               **_run_facts(run)}
    return ScenarioResult(scenario, run, summary, {}, _judged(run, goals, scenario.load_changes or 0), {})


def _no_summary(*_: Any) -> tuple[dict[str, Any], dict[str, bool]]:
    return {}, {}  # judged by their own runs (RUNS)


# name -> (build, summarize) as closed_loop_scenarios.SCENARIOS has them; their runs are RUNS'.
SCENARIOS = {"mixed-objectives": (mixed_objectives, _no_summary), "tenants": (tenants, _no_summary)}
RUNS = {"mixed-objectives": run_mixed_objectives, "tenants": run_tenants}


async def run_objective_scenario(name: str, seed: int | None = None) -> "ScenarioResult":
    scenario = SCENARIOS[name][0]()
    if seed is not None:
        scenario = replace(scenario, seed=seed)
    return await RUNS[name](scenario)
