"""What the control loop sees of a replica: targets, observations, the Observer seam. Pure (no I/O).

A replica the loop cannot trust is *unknown*, with the reason: not ready, a failed or timed-out scrape,
or too few latency samples in its window. Unknown never means healthy and never means idle; the tuner
and the scaler refuse to rest a decision on it. A scrape that failed to give latency but did return the
replica's current tuning still reports that tuning, so a restarted replica can be re-tuned at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from stallfree.contracts import Profile, Tuning, WindowStats

NOT_READY = "not ready"


@dataclass(frozen=True)
class ReplicaTarget:
    """One replica the loop should look at. `instance` changes when the replica restarts (pod uid, pid)."""

    name: str
    url: str | None = None  # base URL of the daemon (admin API); None where the observer needs none
    ready: bool = True
    instance: str = ""


@dataclass(frozen=True)
class ReplicaObservation:
    name: str
    ready: bool
    stats: WindowStats | None  # None when nothing could be read
    profile: Profile | None
    unknown_reason: str | None  # None: known (a readable window with enough samples)
    instance: str = ""

    @property
    def known(self) -> bool:
        return self.unknown_reason is None

    @property
    def tuning(self) -> Tuning | None:
        """The tuning the replica runs now, when its stats could be read (even with too few samples)."""
        return self.stats.tuning if self.stats is not None else None


@dataclass(frozen=True)
class ObjectiveWindow:
    """One objective's requests at the router over the stats window (the router measures them per objective).

    Figures the router does not report stay None (or 0): a router of an earlier release reports depth and shed
    counts per objective alone. `completed` requests were judged within the window (answered, or refused once
    queued), `good` of them were answered within their objective's targets; shed ones are not good either.
    """

    name: str
    priority: int = 0
    arrival_prompt_tokens_per_s: float | None = None  # offered: admitted and shed
    recent_prompt_tokens: float = 0.0  # over the last control interval (as QueueObservation's)
    recent_requests: int = 0
    arrival_requests_per_s: float = 0.0
    depth: int = 0
    queued_prompt_tokens: float = 0.0
    oldest_wait_ms: float = 0.0
    shed: int = 0  # refused at arrival over the window
    completed: int = 0
    good: int = 0
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    queue_wait_p99_ms: float | None = None

    @property
    def sheddable(self) -> bool:
        return self.priority < 0

    @property
    def goodput(self) -> float | None:
        """The share of its requests over the window that met every SLO of the objective (None: none judged)."""
        judged = self.completed + self.shed
        return self.good / judged if judged else None


@dataclass(frozen=True)
class QueueObservation:
    """The router's queue as the control loop reads it (the router's /router/queue)."""

    depth: int
    queued_prompt_tokens: float
    oldest_wait_ms: float
    arrival_prompt_tokens_per_s: float  # over the stats window
    # Over the last control interval: (prompt tokens, requests) that arrived, and its length.
    recent_prompt_tokens: float = 0.0
    recent_requests: int = 0
    recent_s: float = 0.0
    # Over the stats window: requests arriving per second and their prompt lengths' squared coefficient of
    # variation (what the queue-wait tail depends on besides the mean; None when too few arrived to tell).
    arrival_requests_per_s: float = 0.0
    prompt_cv2: float | None = None
    objectives: tuple[ObjectiveWindow, ...] = ()  # per objective, where the router reports them


class QueueSource(Protocol):
    async def observe_queue(self, now: float) -> QueueObservation | None: ...


class Observer(Protocol):
    async def observe(self, targets: Sequence[ReplicaTarget], now: float) -> list[ReplicaObservation]: ...


def too_few_samples(stats: WindowStats, min_samples: int) -> str | None:
    """The reason a window cannot carry a decision, or None when it can."""
    counts = {"TTFT": stats.ttft_ms.count, "TPOT": stats.tpot_ms.count}
    short = [f"{name} {count}" for name, count in counts.items() if count < min_samples]
    if short:
        return f"too few samples in {stats.window_s:g}s window ({', '.join(short)} < {min_samples})"
    return None


def classify(target: ReplicaTarget, stats: WindowStats | None, profile: Profile | None, min_samples: int,
             failure: str | None = None) -> ReplicaObservation:
    """One observation from what could be read: unknown unless ready, read and sampled enough."""
    if not target.ready:
        reason: str | None = NOT_READY
    elif stats is None:
        reason = failure or "stats unavailable"
    else:
        reason = too_few_samples(stats, min_samples)
    return ReplicaObservation(target.name, target.ready, stats, profile, reason, target.instance)
