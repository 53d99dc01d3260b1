"""Budget sweep: p99 TTFT and p99 TPOT against the token budget for one workload, and the profile rule's pick.

A small budget keeps iterations short (low TPOT) but cuts prompts into many chunks (high TTFT, and
lower prefill throughput from re-reading KV and paying the overhead more often); a large budget does
the opposite. The rule the daemon and the tuner start from: the largest budget whose predicted
iteration time fits `target_fraction` of the TPOT SLO (profile_rules.budget_for_tpot).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from stallfree.profile_rules import budget_for_tpot
from stallfree.simulator.latency_summary import SLOs
from stallfree.simulator.simulate import SimSetup, simulate
from stallfree.simulator.workload import WorkloadSpec, generate


@dataclass
class SweepPoint:
    token_budget: int
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None
    itl_p99_ms: float | None
    queue_wait_p50_ms: float | None
    goodput: float
    slo_attainment: float


@dataclass
class SweepResult:
    tpot_slo_ms: float
    target_fraction: float
    profile_budget: int  # what the profile rule picks
    best_budget: int | None  # the swept budget with the lowest p99 TTFT whose p99 TPOT meets the SLO
    points: list[SweepPoint] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tpot_slo_ms": self.tpot_slo_ms,
            "target_fraction": self.target_fraction,
            "profile_budget": self.profile_budget,
            "best_budget": self.best_budget,
            "points": [p.__dict__ for p in self.points],
        }


def budget_sweep(workload: WorkloadSpec, setup: SimSetup, budgets: list[int], slos: SLOs,
                 target_fraction: float = 0.8) -> SweepResult:
    if not budgets:
        raise ValueError("give at least one budget to sweep")
    if slos.tpot_ms is None:
        raise ValueError("a budget sweep needs a TPOT SLO")
    requests = generate(workload)
    ceiling = max(max(budgets), setup.max_token_budget or 0)
    points = []
    for budget in sorted(budgets):
        run = replace(setup, policy="stall-free", token_budget=budget, max_token_budget=ceiling)
        summary = simulate(requests, run, slos).summary
        points.append(SweepPoint(budget, summary["ttft_ms"]["p99"], summary["tpot_ms"]["p99"], summary["itl_ms"]["p99"],
                                 summary["queue_wait_ms"]["p50"], summary["goodput"], summary["slo_attainment"]))
    profile = replace(setup, policy="stall-free", token_budget=ceiling, max_token_budget=ceiling).build_replica().profile()
    picked = budget_for_tpot(profile, slos.tpot_ms, lo=min(budgets), hi=ceiling, margin=target_fraction)
    meeting = [p for p in points if p.tpot_p99_ms is not None and p.tpot_p99_ms <= slos.tpot_ms
               and p.ttft_p99_ms is not None]
    best = min(meeting, key=lambda p: p.ttft_p99_ms).token_budget if meeting else None
    return SweepResult(slos.tpot_ms, target_fraction, picked, best, points)
