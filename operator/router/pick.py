"""Which replica serves a request: pure (observations in, choice out; no I/O, no clock).

The slo-aware policy predicts each replica's time to first token for this request:

    predicted TTFT = (prefill tokens queued ahead + this prompt's uncached tokens) / prefill rate + step time

where the prefill rate is the replica's, at its live token budget, read off its profile, and the step
time is its current iteration (the one the first token leaves with). The replica that answers soonest
wins, with prefix affinity: the replica that recently took this prompt's leading blocks (or, for a
prefix never seen, the one rendezvous hashing names its home) keeps it unless its prediction is worse
than the best by more than a margin, because a cache-warm replica skips that prefill entirely.
"""
from __future__ import annotations

import random as _random
from dataclasses import dataclass, replace
from typing import Mapping

POLICIES = ("slo-aware", "least-outstanding", "round-robin", "random")


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica at pick time."""

    name: str
    queued_prefill_tokens: int  # accepted prompt tokens not yet prefilled (its stats + what the router sent since)
    prefill_tokens_per_ms: float  # at its live budget
    step_ms: float  # current iteration time
    outstanding: int  # sequences the router has in flight on it (a request of n choices counts n)
    cached_prefix_tokens: int = 0  # leading tokens of this prompt it recently took (likely in its prefix cache)
    home: bool = False  # rendezvous home of this prompt's first block
    max_num_seqs: int | None = None  # its live running-set cap (flow control keeps outstanding below it)
    # queued_prefill_tokens split by (priority, tenant); None: not known, every request sees all of it.
    queued_by_class: Mapping[tuple[int, str], int] | None = None
    # outstanding split by priority, given when its engine preempts a lower priority for a higher one's slot.
    outstanding_by_priority: Mapping[int, int] | None = None

    def seen_by(self, priority: int) -> "ReplicaView":
        """This replica as a request of `priority` meets it: the engine prefills higher bands first and preempts
        lower ones for a running slot, so only the queued prefill and slots of bands >= `priority` are ahead."""
        if self.queued_by_class is None and self.outstanding_by_priority is None:
            return self
        queued = self.queued_prefill_tokens
        if self.queued_by_class is not None:
            queued = min(queued, sum(n for (p, _), n in self.queued_by_class.items() if p >= priority))
        outstanding = self.outstanding
        if self.outstanding_by_priority is not None:
            outstanding = sum(n for p, n in self.outstanding_by_priority.items() if p >= priority)
        return replace(self, queued_prefill_tokens=queued, outstanding=outstanding)

    def plus(self, prompt_tokens: int, priority: int = 0, tenant: str = "", sequences: int = 1) -> "ReplicaView":
        """As it is once one more request of this class (running `sequences` choices) is sent to it."""
        by_class = by_priority = None
        if self.queued_by_class is not None:
            by_class = dict(self.queued_by_class)
            by_class[(priority, tenant)] = by_class.get((priority, tenant), 0) + prompt_tokens
        if self.outstanding_by_priority is not None:
            by_priority = dict(self.outstanding_by_priority)
            by_priority[priority] = by_priority.get(priority, 0) + sequences
        return replace(self, queued_prefill_tokens=self.queued_prefill_tokens + prompt_tokens,
                       outstanding=self.outstanding + sequences, queued_by_class=by_class,
                       outstanding_by_priority=by_priority)

    def has_slots(self, sequences: int = 1) -> bool:
        """Its running set takes `sequences` more now (an idle replica takes any request: n past max_num_seqs
        would otherwise wait forever)."""
        return self.max_num_seqs is None or self.outstanding == 0 or self.outstanding + sequences <= self.max_num_seqs


@dataclass(frozen=True)
class Choice:
    name: str
    predicted_ttft_ms: float | None  # None for policies that predict nothing
    reason: str  # "fastest", "affinity", "home", "least-outstanding", "round-robin", "random"


@dataclass(frozen=True)
class AffinityMargin:
    """A cache-warm replica may be this much slower than the fastest and still win."""

    absolute_ms: float = 50.0
    relative: float = 0.25

    def allows(self, candidate_ms: float, best_ms: float) -> bool:
        return candidate_ms <= best_ms + max(self.absolute_ms, self.relative * best_ms)


def predict_ttft_ms(replica: ReplicaView, prompt_tokens: int) -> float:
    uncached = max(0, prompt_tokens - replica.cached_prefix_tokens)
    rate = max(replica.prefill_tokens_per_ms, 1e-6)
    return (replica.queued_prefill_tokens + uncached) / rate + replica.step_ms


def pick_slo_aware(replicas: list[ReplicaView], prompt_tokens: int,
                   margin: AffinityMargin = AffinityMargin()) -> Choice:
    predictions = [(predict_ttft_ms(r, prompt_tokens), r) for r in replicas]
    best_ms, best = min(predictions, key=lambda p: (p[0], p[1].outstanding, p[1].name))
    warm = [p for p in predictions if p[1].cached_prefix_tokens > 0]
    if warm:
        # The longest cached prefix first; among equals the sooner one.
        warm_ms, warm_replica = max(warm, key=lambda p: (p[1].cached_prefix_tokens, -p[0]))
        if warm_replica is not best and margin.allows(warm_ms, best_ms):
            return Choice(warm_replica.name, warm_ms, "affinity")
        if warm_replica is best:
            return Choice(best.name, best_ms, "affinity")
    for ms, replica in predictions:
        if replica.home and replica is not best and margin.allows(ms, best_ms):
            return Choice(replica.name, ms, "home")
    return Choice(best.name, best_ms, "fastest")


def pick_least_outstanding(replicas: list[ReplicaView]) -> Choice:
    best = min(replicas, key=lambda r: (r.outstanding, r.name))
    return Choice(best.name, None, "least-outstanding")


def pick(policy: str, replicas: list[ReplicaView], prompt_tokens: int, counter: int,
         rng: _random.Random | None = None, margin: AffinityMargin = AffinityMargin()) -> Choice:
    """The replica for one request among `replicas` (the healthy ones; never empty).

    `counter` is the router's request sequence number (round-robin's position); `rng` serves `random`.
    """
    if not replicas:
        raise ValueError("no replica to pick from")
    if policy == "slo-aware":
        return pick_slo_aware(replicas, prompt_tokens, margin)
    if policy == "least-outstanding":
        return pick_least_outstanding(replicas)
    if policy == "round-robin":
        ordered = sorted(replicas, key=lambda r: r.name)
        return Choice(ordered[counter % len(ordered)].name, None, "round-robin")
    if policy == "random":
        return Choice((rng or _random).choice(replicas).name, None, "random")
    raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(POLICIES)}")


def rendezvous_home(key: int, names: list[str]) -> str:
    """Highest-random-weight hashing: a key's home moves only when its own replica leaves."""
    from zlib import crc32

    return max(names, key=lambda n: (crc32(f"{n}/{key}".encode()), n))
