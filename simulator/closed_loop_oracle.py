"""An offline oracle for a closed-loop scenario: the fewest replicas at each moment meeting every SLO.

It knows the future (each load phase's rate and lengths, from the scenario) and has the replicas a
phase needs ready the moment it starts. For each phase it searches the smallest count n (within the
scenario's replica bounds) and a budget from the replica's own profile such that n replicas carrying
the phase's Poisson arrivals on the same cost model, routed as the cluster routes them (VirtualCluster:
the router's queue), keep >= 95% of their steady-state windows within every SLO, judged as the run is:
the worst replica's p99 per window. It pays what the spec makes any controller pay: replicas are asked
for the start-up time before their phase and kept the scale-down stabilization window after it. Its
replica-minutes are the yardstick for the controller's; an SLO the oracle cannot meet at maxReplicas is
infeasible there. It knows the true speed of the replicas (speed.py), which the controller does not.
"""
from __future__ import annotations

import random
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from stallfree.contracts import Tuning, min_budget_for
from stallfree.profile_rules import budget_for_tpot, give_way, prefill_tokens_per_s
from stallfree.simulator.closed_loop import LoadPhase, VirtualCluster, poisson_arrivals
from stallfree.simulator.closed_loop_judge import SLOS, WINDOW_FRACTION
from stallfree.simulator.speed import SpeedSchedule
from stallfree.simulator.virtual_replica import VirtualReplica
from stallfree.operator.control.observe import too_few_samples

if TYPE_CHECKING:
    from stallfree.simulator.closed_loop_scenarios import Scenario

WARMUP_S, STEADY_S = 30.0, 120.0


def oracle(scenario: "Scenario") -> dict[str, Any]:
    phases = _split_at_speed_change(scenario)
    rows, minutes = [], 0.0
    weighted: dict[str, float] = {name: 0.0 for name, *_ in SLOS}
    infeasible: set[str] = set()
    for i, phase in enumerate(phases):
        end = phases[i + 1].start_s if i + 1 < len(phases) else scenario.duration_s
        span = max(0.0, min(end, scenario.duration_s) - phase.start_s)
        if span <= 0:
            continue
        n, budget, fractions = fewest_replicas(scenario, phase)
        minutes += n * span / 60.0
        for name, value in fractions.items():
            weighted[name] += value * span
            if value < WINDOW_FRACTION:
                infeasible.add(name)
        rows.append({"start_s": phase.start_s, "seconds": span, "replicas": n, "token_budget": budget,
                     "window_fraction": fractions, "label": phase.label})
    minutes = paid_replica_minutes(rows, scenario.cluster.startup_s, scenario.policy.scaling.scale_down_stabilization_s,
                                   scenario.duration_s)
    total = sum(r["seconds"] for r in rows) or 1.0
    fraction = {name: round(v / total, 3) for name, v in weighted.items()}
    return {"replica_minutes": round(minutes, 2), "slo_window_fraction": min(fraction.values()),
            "window_fraction": fraction, "infeasible": sorted(infeasible), "phases": rows}


def paid_replica_minutes(rows: list[dict[str, Any]], startup_s: float, stabilization_s: float,
                         duration_s: float) -> float:
    """Replica-minutes the oracle pays: a phase's count asked for `startup_s` before it starts (ready the
    moment it starts) and kept `stabilization_s` after it ends (the spec's scale-down window), as the
    controller pays them. Replicas cost from the run's start at the earliest."""
    step, paid = 1.0, 0.0
    t = 0.0
    while t < duration_s:
        need = 0
        for r in rows:
            start, end = r["start_s"], r["start_s"] + r["seconds"]
            if start - startup_s <= t < end + stabilization_s or start <= t < end:
                need = max(need, r["replicas"])
        paid += need * step
        t += step
    return round(paid / 60.0, 2)


def fewest_replicas(scenario: "Scenario", phase: LoadPhase) -> tuple[int, int, dict[str, float]]:
    """(replicas, budget, per-SLO window fraction) of the cheapest setting meeting every SLO. When none does
    at maxReplicas: the setting that holds the SLOs best in the spec's priority order (TPOT first)."""
    scaling, priority = scenario.policy.scaling, scenario.policy.slo_priority
    keys = {"tpot": "tpot", "queueWait": "queue_wait", "ttft": "ttft"}

    def rank(fractions: dict[str, float]) -> tuple[bool, ...]:
        return tuple(fractions[keys[p]] >= WINDOW_FRACTION for p in priority) + (min(fractions.values()),)

    best: tuple[int, int, dict[str, float]] | None = None
    demand = phase.rate * _mean(phase.prompt_len)
    for n in range(max(1, scaling.min_replicas), scaling.max_replicas + 1):
        for budget in _budgets(scenario):
            bound = _prefill_bound(scenario, budget) * scenario.cluster.speed.at(phase.start_s)
            if demand > n * bound and n < scaling.max_replicas:
                continue  # more prompt tokens than n replicas can prefill even without decodes: a sure miss
            fractions = _steady(scenario, phase.rate, n, phase.prompt_len.describe(), phase.output_len.describe(),
                                budget, phase.start_s)
            if min(fractions.values()) >= WINDOW_FRACTION:
                return n, budget, fractions
            if n == scaling.max_replicas and (best is None or rank(fractions) > rank(best[2])):
                best = (n, budget, fractions)
            if fractions["tpot"] >= WINDOW_FRACTION and n < scaling.max_replicas:
                break  # TPOT holds, queues do not: a smaller budget only prefills less; try more replicas
    assert best is not None
    return best


def _budgets(scenario: "Scenario") -> list[int]:
    """Candidate budgets, largest first: the profile's for 100%, 80% and 60% of the TPOT SLO."""
    spec = scenario.cluster
    profile = _replica(scenario, spec.start_tuning).profile()
    seqs, hi = spec.start_tuning.max_num_seqs, spec.ceilings.max_token_budget
    floor = min(hi, min_budget_for(seqs))
    out = {max(floor, budget_for_tpot(profile, scenario.policy.slo.tpot_p99_ms, lo=1, hi=hi, margin=f))
           for f in (1.0, 0.8, 0.6)}
    return sorted(out, reverse=True)


def _replica(scenario: "Scenario", tuning: Tuning) -> VirtualReplica:
    spec = scenario.cluster
    return VirtualReplica.for_model(spec.model, spec.hardware, tuning=tuning, ceilings=spec.ceilings,
                                    max_model_len=spec.max_model_len, dtype=spec.dtype,
                                    stats_window_s=scenario.policy.window_s)


def _mean(dist, samples: int = 4000) -> float:
    rng = random.Random(4321)
    return sum(dist.sample(rng) for _ in range(samples)) / samples


def _prefill_bound(scenario: "Scenario", budget: int) -> float:
    """Prompt tokens/s one replica could prefill at `budget` if no decode took a token: an upper bound."""
    profile = _replica(scenario, scenario.cluster.start_tuning).profile()
    rate = prefill_tokens_per_s(profile, budget, decodes=0)
    return float("inf") if rate is None else rate


def _split_at_speed_change(scenario: "Scenario") -> list[LoadPhase]:
    """The load phases, one more where the replicas' true speed changes (the oracle knows it does)."""
    phases = sorted(scenario.phases, key=lambda p: p.start_s)
    change = scenario.cluster.speed.change_at_s
    if change is None or change >= scenario.duration_s:
        return phases
    current = next((p for p in reversed(phases) if p.start_s <= change), None)
    if current is None or any(p.start_s == change for p in phases):
        return phases
    return sorted(phases + [replace(current, start_s=change, label=f"{current.label} (speed changes)")],
                  key=lambda p: p.start_s)


def _steady(scenario: "Scenario", rate: float, replicas: int, prompt: str, output: str,
            budget: int, start_s: float = 0.0) -> dict[str, float]:
    speed = scenario.cluster.speed.at(start_s)  # the truth over this phase, which the controller must learn
    return dict(_steady_cached(scenario.name, scenario.seed, round(rate, 6), replicas, prompt, output, budget,
                               speed))


@lru_cache(maxsize=None)
def _steady_cached(name: str, seed: int, rate: float, replicas: int, prompt: str, output: str,
                   budget: int, speed: float = 1.0) -> tuple[tuple[str, float], ...]:
    from stallfree.simulator.closed_loop_scenarios import SCENARIOS  # the scenario by name (cache key)
    from stallfree.simulator.workload import parse_length

    scenario = replace(SCENARIOS[name][0](), seed=seed)
    _, seqs = give_way(budget, scenario.cluster.start_tuning.max_num_seqs, 1, budget)
    tuning = Tuning(budget, seqs)
    window, slo = scenario.policy.window_s, scenario.policy.slo
    cluster = VirtualCluster(replace(scenario.cluster, start_tuning=tuning, speed=SpeedSchedule(speed),
                                     queue_wait_slo_ms=scenario.cluster.queue_wait_slo_ms or slo.queue_wait_p99_ms),
                             window, replicas)
    phase = LoadPhase(0.0, rate, parse_length(prompt), parse_length(output))
    rng = random.Random(seed + 7)
    arrivals = poisson_arrivals(phase, 0.0, WARMUP_S + STEADY_S, rng)
    within = {name: [0, 0] for name, *_ in SLOS}
    t, sent = 0.0, 0

    def until(end: float) -> None:  # arrivals up to `end` through the cluster's router, then time to `end`
        nonlocal sent
        batch = [a for a in arrivals[sent:] if a[0] <= end]
        sent += len(batch)
        cluster.submit(batch, end)
        cluster.advance_to(end)

    until(WARMUP_S)
    t = WARMUP_S
    while t + window <= WARMUP_S + STEADY_S + 1e-9:
        t += window
        until(t)
        stats = [slot.replica.window_stats(t) for slot in cluster.slots.values()]
        stats = [s for s in stats if too_few_samples(s, scenario.policy.min_samples) is None]  # known ones
        for name, attr, limit in (("tpot", "tpot_ms", slo.tpot_p99_ms),
                                  ("queue_wait", "queue_wait_ms", slo.queue_wait_p99_ms),
                                  ("ttft", "ttft_ms", slo.ttft_p99_ms)):
            values = [getattr(s, attr).p99 for s in stats if getattr(s, attr).p99 is not None]
            if values:  # the worst replica's, as the run's timeline judges
                within[name][1] += 1
                within[name][0] += max(values) <= limit
    # Work still queued at the end is windows not yet judged: a growing backlog fails queue wait and TTFT.
    waiting = sum(slot.replica.num_waiting for slot in cluster.slots.values()) + len(cluster.router.queue)
    if waiting > max(2, rate * window):
        within["queue_wait"][0] = within["ttft"][0] = 0
    return tuple((name, (ok / n) if n else 1.0) for name, (ok, n) in within.items())
