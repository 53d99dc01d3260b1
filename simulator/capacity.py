"""Capacity as Sarathi-Serve defines it: the highest request rate a replica sustains while p99 time
between tokens stays under an SLO and the median scheduling delay (queue wait) under a limit (2 s).

Found by bisection over the rate. Every probe replays the same workload (same seed): the arrival gaps
scale with 1/rate and the lengths are identical, so probes differ only in the load (common random
numbers keep the search from chasing noise).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from stallfree.simulator.latency_summary import SLOs
from stallfree.simulator.simulate import SimSetup, simulate
from stallfree.simulator.workload import WorkloadSpec, generate


@dataclass(frozen=True)
class CapacityCriteria:
    tbt_slo_ms: float = 100.0
    tbt_quantile: str = "p99"  # p50 | p90 | p99 | max of every inter-token gap
    max_median_queue_wait_ms: float = 2000.0


@dataclass
class Probe:
    rate: float
    tbt_ms: float | None
    median_queue_wait_ms: float | None
    ok: bool


@dataclass
class CapacityResult:
    policy: str
    capacity_rps: float  # highest rate that passed (0.0 when even the lowest probe failed)
    criteria: CapacityCriteria
    probes: list[Probe] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "capacity_rps": self.capacity_rps,
            "criteria": self.criteria.__dict__,
            "probes": [p.__dict__ for p in self.probes],
        }


def probe(workload: WorkloadSpec, setup: SimSetup, rate: float, criteria: CapacityCriteria) -> Probe:
    requests = generate(replace(workload, arrival=_arrival(workload), rate=rate))
    summary = simulate(requests, setup, SLOs()).summary
    tbt = summary["itl_ms"][criteria.tbt_quantile]
    wait = summary["queue_wait_ms"]["p50"]
    ok = (tbt is None or tbt <= criteria.tbt_slo_ms) and wait is not None and wait <= criteria.max_median_queue_wait_ms
    return Probe(rate, tbt, wait, ok)


def find_capacity(workload: WorkloadSpec, setup: SimSetup, criteria: CapacityCriteria = CapacityCriteria(),
                  start_rate: float = 1.0, rel_tol: float = 0.02, max_probes: int = 30,
                  on_probe: Callable[[Probe], None] | None = None) -> CapacityResult:
    """Double the rate until a probe fails, then bisect between the last pass and the first failure.

    `on_probe` hears every probe as it finishes (a search over a large workload takes minutes)."""
    if start_rate <= 0 or not 0 < rel_tol < 1:
        raise ValueError("start_rate must be positive and rel_tol within (0, 1)")
    probes: list[Probe] = []

    def run(rate: float) -> bool:
        result = probe(workload, setup, rate, criteria)
        probes.append(result)
        if on_probe is not None:
            on_probe(result)
        return result.ok

    lo, hi = 0.0, start_rate
    while run(hi):
        lo, hi = hi, hi * 2
        if len(probes) >= max_probes:
            break
    while hi - lo > rel_tol * hi and len(probes) < max_probes:
        mid = (lo + hi) / 2 if lo > 0 else hi / 4
        if run(mid):
            lo = mid
        else:
            hi = mid
        if lo == 0 and hi < start_rate * 1e-3:
            break  # nothing passes even at a trickle
    return CapacityResult(setup.policy, lo, criteria, probes)


def _arrival(workload: WorkloadSpec) -> str:
    if workload.arrival == "trace":
        raise ValueError("a capacity search varies the rate: use a poisson or gamma workload, not a trace")
    return workload.arrival
