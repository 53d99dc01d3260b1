"""The demand the scaler sizes for when objectives differ: the protected ones, and sheddable ones within a share. Pure.

Requests of a sheddable objective (priority < 0) use the capacity the others leave: the router sends them only
when a replica can start them soon and refuses them at arrival when they are predicted to miss. The count is
sized for the non-sheddable (protected) objectives' demand; a sheddable demand may add replicas only up to
`sheddable_scale_out_share` of maxReplicas' capacity, or a batch flood would scale the service to its maximum.

The router reports arrivals per objective; the replicas' windows do not tell objectives apart, so what they
show (prompt tokens arriving and prefilled, their queues) is counted at the sized share of the whole demand.
The replicas' TTFT and queue-wait windows hold the batch requests' long waits in the router's queue too, so
whether the service breaches is read off the protected objectives' own windows, where the router gives them.
Without a sheddable objective, or without per-objective arrivals, nothing changes (`split_demand` is None).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from stallfree.operator.control.observe import ObjectiveWindow, QueueObservation
from stallfree.operator.control.policy import ObjectiveTargets
from stallfree.operator.control.scaler import ReplicaLoad


@dataclass(frozen=True)
class DemandSplit:
    """Prompt tokens/s over the stats window, by whether the scaler sizes for them."""

    protected_tokens_per_s: float  # non-sheddable objectives: sized for in full
    sheddable_tokens_per_s: float  # offered by sheddable objectives (admitted or shed)
    sheddable_allowed_tokens_per_s: float  # the most of it the count may grow for

    @property
    def total_tokens_per_s(self) -> float:
        return self.protected_tokens_per_s + self.sheddable_tokens_per_s

    @property
    def sheddable_counted(self) -> float:
        """The share of the sheddable demand sized for (0..1)."""
        if self.sheddable_tokens_per_s <= 0:
            return 0.0
        return min(1.0, self.sheddable_allowed_tokens_per_s / self.sheddable_tokens_per_s)

    @property
    def sized_tokens_per_s(self) -> float:
        return self.protected_tokens_per_s + self.sheddable_tokens_per_s * self.sheddable_counted

    @property
    def fraction(self) -> float:
        """The sized share of the whole demand (what the replicas' own figures are counted at)."""
        total = self.total_tokens_per_s
        return self.sized_tokens_per_s / total if total > 0 else 1.0


def split_demand(queue: QueueObservation | None, share: float, max_replicas: int,
                 capacity_per_replica: float | None) -> DemandSplit | None:
    """The split, or None when nothing is sheddable or the router does not report arrivals per objective.
    `capacity_per_replica`: prompt tokens/s one replica prefills (unknown: sheddable demand adds no replica)."""
    windows = queue.objectives if queue is not None else ()
    if not any(w.sheddable for w in windows) or any(w.arrival_prompt_tokens_per_s is None for w in windows):
        return None
    protected = sum(w.arrival_prompt_tokens_per_s or 0.0 for w in windows if not w.sheddable)
    sheddable = sum(w.arrival_prompt_tokens_per_s or 0.0 for w in windows if w.sheddable)
    allowed = share * max_replicas * capacity_per_replica if capacity_per_replica else 0.0
    return DemandSplit(protected, sheddable, allowed)


def sized_queue(queue: QueueObservation, split: DemandSplit) -> QueueObservation:
    """The router's queue as the scaler sizes for it: the protected objectives' waiting work and oldest wait,
    their arrivals plus the counted share of the sheddable ones'."""
    protected = [w for w in queue.objectives if not w.sheddable]
    sheddable = [w for w in queue.objectives if w.sheddable]
    counted = split.sheddable_counted

    def total(attr: str) -> float:
        return sum(getattr(w, attr) for w in protected) + counted * sum(getattr(w, attr) for w in sheddable)

    return replace(queue, depth=sum(w.depth for w in protected),
                   queued_prompt_tokens=sum(w.queued_prompt_tokens for w in protected),
                   oldest_wait_ms=max((w.oldest_wait_ms for w in protected), default=0.0),
                   arrival_prompt_tokens_per_s=split.sized_tokens_per_s,
                   recent_prompt_tokens=total("recent_prompt_tokens"),
                   recent_requests=round(total("recent_requests")),
                   arrival_requests_per_s=total("arrival_requests_per_s"))


def protected_breaching(windows: Sequence[ObjectiveWindow], targets: Sequence[ObjectiveTargets]) -> bool | None:
    """Whether a protected objective's p99 TTFT or queue wait (the router's window) is over its target; None when
    no protected objective has such a window."""
    by_name = {t.name: t for t in targets}
    seen, breaching = False, False
    for w in windows:
        target = by_name.get(w.name)
        if w.sheddable or target is None:
            continue
        for p99, limit in ((w.ttft_p99_ms, target.ttft_p99_ms), (w.queue_wait_p99_ms, target.queue_wait_p99_ms)):
            if p99 is not None and limit is not None:
                seen = True
                breaching = breaching or p99 > limit
    return breaching if seen else None


def sized_loads(loads: Sequence[ReplicaLoad], split: DemandSplit, breaching: bool | None,
                tpot_met: dict[str, bool]) -> list[ReplicaLoad]:
    """Each replica's figures at the sized share; where the protected objectives' windows say whether the
    service breaches, that replaces the replica's own verdict (its TPOT, the engine's, still counts)."""
    f = split.fraction
    out = []
    for load in loads:
        sized = replace(load, prompt_tokens_per_s=load.prompt_tokens_per_s * f,
                        prefill_tokens_per_s=load.prefill_tokens_per_s * f,
                        queued_prompt_tokens=load.queued_prompt_tokens * f, num_waiting=int(load.num_waiting * f))
        if load.known and breaching is not None:
            sized = replace(sized, breaching=breaching, slo_met=not breaching and tpot_met.get(load.name, True))
        out.append(sized)
    return out


def sized_for_scaler(queue: QueueObservation | None, loads: list[ReplicaLoad],
                     stats_tpot_p99_ms: dict[str, float | None],
                     targets: Sequence[ObjectiveTargets], tpot_slo_ms: float, share: float, max_replicas: int,
                     capacity_per_replica: float | None) -> tuple[list[ReplicaLoad], QueueObservation | None]:
    """The replicas' loads and the router's queue as the scaler sizes them (unchanged without a split)."""
    split = split_demand(queue, share, max_replicas, capacity_per_replica)
    if split is None or queue is None:
        return loads, queue
    tpot_met = {name: (p99 or 0.0) <= tpot_slo_ms for name, p99 in stats_tpot_p99_ms.items()}
    return sized_loads(loads, split, protected_breaching(queue.objectives, targets), tpot_met), \
        sized_queue(queue, split)
