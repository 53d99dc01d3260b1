"""Flow control: requests wait in the router's queue, not on a replica. Pure (no I/O, no clock of its own).

A request is dispatched only when some replica can start it soon: the prefill work already queued on
it, at its (calibrated) prefill rate, drains within `dispatch_wait_ms` (a share of the queue-wait SLO),
and it has a free running slot (the router's requests in flight there below its max_num_seqs). Until
then it waits here, in arrival order (strict FIFO: a request never overtakes an earlier one), so a
replica that becomes ready, or one that frees a slot, takes the oldest waiting request at once instead
of a backlog staying on the replica it was routed to. The queue is bounded: past `max_queued` a new
request is refused (the HTTP edge answers 429 with Retry-After).

The same queue runs in the router (proxy.py) and in the virtual-time cluster (simulator/closed_loop.py),
so the closed-loop scenarios exercise the dispatch rule the cluster serves with.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Generic, Hashable, Iterator, TypeVar

from stallfree.operator.router.pick import Choice, ReplicaView

K = TypeVar("K", bound=Hashable)

# Without a queue-wait SLO: dispatch while a replica's queued prefill drains within this long.
DEFAULT_DISPATCH_WAIT_MS = 500.0
# The share of the queue-wait SLO a request may wait on its replica once dispatched (the rest is the router's).
SLO_SHARE = 0.25


def dispatch_wait_ms(queue_wait_slo_ms: float | None) -> float:
    return DEFAULT_DISPATCH_WAIT_MS if not queue_wait_slo_ms else SLO_SHARE * queue_wait_slo_ms


@dataclass(frozen=True)
class FlowConfig:
    dispatch_wait_ms: float = DEFAULT_DISPATCH_WAIT_MS
    max_queued: int = 1024  # requests waiting at most; past it, refused (429)


@dataclass
class Queued(Generic[K]):
    key: K
    arrival_s: float
    prompt_tokens: int
    exclude: frozenset[str] = frozenset()  # replicas that already failed this request (tried first elsewhere)


def admits(view: ReplicaView, config: FlowConfig) -> bool:
    """Can this replica start one more request soon? An idle replica always can."""
    if view.max_num_seqs is not None and view.outstanding >= view.max_num_seqs:
        return False
    if view.queued_prefill_tokens <= 0:
        return True
    rate = max(view.prefill_tokens_per_ms, 1e-6)
    return view.queued_prefill_tokens / rate <= config.dispatch_wait_ms


@dataclass
class FlowQueue(Generic[K]):
    config: FlowConfig = field(default_factory=FlowConfig)
    _waiting: "OrderedDict[K, Queued[K]]" = field(default_factory=OrderedDict)
    arrivals: int = 0
    rejected: int = 0
    cancelled: int = 0
    dispatched: int = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Queued[K]]:
        return iter(self._waiting.values())

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(q.prompt_tokens for q in self._waiting.values())

    def oldest_arrival_s(self) -> float | None:
        return next(iter(self._waiting.values())).arrival_s if self._waiting else None

    def push(self, item: Queued[K], front: bool = False) -> bool:
        """Queue a request; False (refused) when the queue is full. `front`: a retry keeps its place."""
        if not front:
            self.arrivals += 1
        if len(self._waiting) >= self.config.max_queued and not front:
            self.rejected += 1
            return False
        self._waiting[item.key] = item
        if front:
            self._waiting.move_to_end(item.key, last=False)
        return True

    def cancel(self, key: K) -> bool:
        """A client that left while queued: removed, counted as cancelled."""
        if self._waiting.pop(key, None) is None:
            return False
        self.cancelled += 1
        return True

    def dispatch(self, views: list[ReplicaView],
                 choose: Callable[[Queued[K], list[ReplicaView]], Choice]) -> list[tuple[Queued[K], Choice]]:
        """Take waiting requests in arrival order while some replica admits the oldest one.

        `views` are the healthy replicas; `choose` picks among those that admit (the routing policy). Each
        dispatch counts on the chosen view at once (its queued prefill and in-flight count), so one call
        spreads a backlog over the replicas as their real state would after each send.
        """
        out: list[tuple[Queued[K], Choice]] = []
        current = {v.name: v for v in views}
        while self._waiting:
            head = next(iter(self._waiting.values()))
            ready = [v for v in current.values() if admits(v, self.config)]
            preferred = [v for v in ready if v.name not in head.exclude]
            candidates = preferred or ready
            if not candidates:
                break
            choice = choose(head, candidates)
            del self._waiting[head.key]
            self.dispatched += 1
            out.append((head, choice))
            v = current[choice.name]
            current[choice.name] = replace(v, queued_prefill_tokens=v.queued_prefill_tokens + head.prompt_tokens,
                                           outstanding=v.outstanding + 1)
        return out
