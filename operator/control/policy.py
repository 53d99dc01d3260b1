"""What one InferenceService asks of its control loop: SLOs, live tuning bounds, scaling rules, cadence.

Plain frozen dataclasses so the pure tuner and scaler take them without pydantic; `from_spec` reads
them off the parsed spec (operator/api/spec.py), which already holds the defaults and cross-field rules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stallfree.contracts import Ceilings, min_budget_for

if TYPE_CHECKING:
    from stallfree.operator.api.spec import InferenceServiceSpec


@dataclass(frozen=True)
class SLOTargets:
    """p99 targets in milliseconds."""

    ttft_p99_ms: float = 2000.0
    tpot_p99_ms: float = 100.0
    queue_wait_p99_ms: float = 1000.0


@dataclass(frozen=True)
class TuningBounds:
    """Where the tuner may move the live knobs; always clipped again under each replica's ceilings."""

    min_token_budget: int = 64
    max_token_budget: int = 1 << 16
    min_num_seqs: int = 1
    max_num_seqs: int = 1 << 16

    def clipped(self, ceilings: Ceilings) -> "TuningBounds":
        """The bounds a replica started with `ceilings` can honour (ceilings win over the spec)."""
        max_budget = min(self.max_token_budget, ceilings.max_token_budget)
        max_seqs = min(self.max_num_seqs, ceilings.max_num_seqs)
        min_seqs = min(self.min_num_seqs, max_seqs)
        min_budget = min(max(self.min_token_budget, min_budget_for(min_seqs)), max_budget)
        return TuningBounds(min_budget, max_budget, min_seqs, max_seqs)


@dataclass(frozen=True)
class ScalingPolicy:
    mode: str = "managed"  # managed: the operator sets replicas; external: HPA/KEDA do, we publish desired
    min_replicas: int = 1
    max_replicas: int = 8
    # Capacity must stay exhausted this long before scaling up; also the pause after a scale-up.
    scale_up_stabilization_s: float = 30.0
    # Scale-in only after every recommendation of this long a window allowed the smaller count.
    scale_down_stabilization_s: float = 300.0
    # Up: size for demand at this fraction of capacity. Down: the smaller count must carry the load at this fraction.
    scale_up_utilisation: float = 0.9
    scale_down_utilisation: float = 0.85
    # Scale-out drains the queued prefill work within this long (from_spec: tied to the queue-wait SLO).
    drain_target_s: float = 60.0
    # Demand beyond this multiple of the known capacity scales out without waiting out the stabilization.
    panic_ratio: float = 2.0
    # Sheddable objectives use the capacity the others leave; their demand may add replicas only up to this share
    # of maxReplicas' capacity (objective_demand.py).
    sheddable_scale_out_share: float = 0.25

    def __post_init__(self) -> None:
        if self.mode not in ("managed", "external"):
            raise ValueError(f"scaling mode must be 'managed' or 'external', got {self.mode!r}")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 1 <= minReplicas ({self.min_replicas}) <= maxReplicas ({self.max_replicas})")
        if not 0 < self.scale_down_utilisation <= self.scale_up_utilisation <= 1:
            raise ValueError("need 0 < scale-down utilisation <= scale-up utilisation <= 1")
        if not 0.0 <= self.sheddable_scale_out_share <= 1.0:
            raise ValueError(f"sheddable scale-out share must be in [0, 1], got {self.sheddable_scale_out_share}")


@dataclass(frozen=True)
class ObjectiveTargets:
    """One class of requests (spec.objectives, resolved against spec.slos): its priority and p99 targets (ms)."""

    name: str
    priority: int = 0
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    queue_wait_p99_ms: float | None = None
    default: bool = False

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


# The backlog a scale-out drains must be gone within this many queue-wait SLOs (30 s at the least).
DRAIN_SLO_MULTIPLE, MIN_DRAIN_S = 15.0, 30.0


def drain_target_s(queue_wait_p99_ms: float) -> float:
    return max(MIN_DRAIN_S, DRAIN_SLO_MULTIPLE * queue_wait_p99_ms / 1000.0)


@dataclass(frozen=True)
class ControlPolicy:
    slo: SLOTargets = field(default_factory=SLOTargets)
    bounds: TuningBounds = field(default_factory=TuningBounds)
    scaling: ScalingPolicy = field(default_factory=ScalingPolicy)
    tuning_enabled: bool = True
    # The spec's fixed starting budget; None ("auto") starts from each replica's profile.
    initial_token_budget: int | None = None
    interval_s: float = 10.0
    window_s: float = 10.0  # the daemons' stats window (the tuner waits this long after a change)
    min_samples: int = 5  # fewer latency samples in a window: that replica is unknown
    # Which SLO to hold first when they conflict (spec.slos.priority).
    slo_priority: tuple[str, ...] = ("tpot", "queueWait", "ttft")
    # The service's objectives (empty: one implicit objective with `slo`); per-objective windows are judged by them.
    objectives: tuple[ObjectiveTargets, ...] = ()

    @classmethod
    def from_spec(cls, spec: "InferenceServiceSpec") -> "ControlPolicy":
        """The policy an InferenceService's parsed spec declares."""
        engine, ceilings = spec.engine, spec.engine.ceilings
        budget, seqs = engine.token_budget, engine.max_num_seqs
        return cls(
            slo=SLOTargets(ttft_p99_ms=spec.slos.ttft_p99_ms, tpot_p99_ms=spec.slos.tpot_p99_ms,
                           queue_wait_p99_ms=spec.slos.queue_wait_p99_ms),
            bounds=TuningBounds(
                min_token_budget=budget.min if budget.min is not None else TuningBounds.min_token_budget,
                max_token_budget=budget.upper(ceilings),
                min_num_seqs=seqs.min,
                max_num_seqs=seqs.upper(ceilings),
            ),
            scaling=ScalingPolicy(
                mode=spec.scaling.mode,
                min_replicas=spec.scaling.min_replicas,
                max_replicas=spec.scaling.max_replicas,
                scale_up_stabilization_s=float(spec.scaling.scale_up_stabilization_seconds),
                scale_down_stabilization_s=float(spec.scaling.scale_down_stabilization_seconds),
                drain_target_s=drain_target_s(spec.slos.queue_wait_p99_ms),
                sheddable_scale_out_share=spec.scaling.sheddable_scale_out_share,
            ),
            tuning_enabled=spec.tuning.mode != "off",
            initial_token_budget=None if isinstance(budget.initial, str) else budget.initial,
            interval_s=spec.tuning.interval_seconds,
            window_s=spec.slos.window_seconds,
            slo_priority=tuple(spec.slos.priority),
            objectives=tuple(ObjectiveTargets(o.name, o.priority, o.ttft_p99_ms, o.tpot_p99_ms, o.queue_wait_p99_ms,
                                              o.default) for o in spec.resolved_objectives()),
        )
