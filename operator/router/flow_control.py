"""Flow control: requests wait in the router's queue, not on a replica. Pure (no I/O, no clock of its own).

A request is dispatched only when the replica that would start it soonest (or one predicted within the
hold margin of it) can start it soon: the prefill work already queued there, at its (calibrated)
prefill rate, drains within `dispatch_wait_ms` (a share of the queue-wait SLO), and it has a free
running slot (the router's requests in flight there below its max_num_seqs). Until then it waits here,
in order (no request waits behind a later one for the same replica), so a replica that becomes
ready, or one that frees a slot, takes the oldest waiting request at once instead of a backlog staying
on the replica it was routed to. The queue is bounded: past `max_queued` a new request is refused (the
HTTP edge answers 429 with Retry-After), and so is one whose flow (its band and tenant) already holds its share of
that bound (`share`): a flood fills its own share, and a quieter tenant's or band's request still finds room.

The order (`ordered`): priority bands strictly, highest first; within a band, tenants take turns, the one served
least recently first; within a tenant, earliest deadline first (arrival plus the objective's TTFT target, less
the predicted prefill), then arrival. Requests without a deadline, one tenant, one band: arrival order, as
before objectives. Only the order changes: which replica, and when, are the dispatch rule's above.

Judged per band and tenant: the engine prefills higher bands first and preempts a lower band's running request
for a higher one's slot, so a request meets only the queued prefill and the running slots of its band and higher
(`ReplicaView.seen_by`). Within a band the engine serves first come, first served, so a tenant that offered more
than FLOOD_SHARE times its fair share of the band's prompt tokens over the last TENANT_MEMORY_S is sent one below
its band (`Queued.sent_priority`, signed so to the engine): the other tenants' requests neither count its queued
prefill here nor wait for it in the engine, and it takes the capacity they leave. One tenant: as before.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Iterator, TypeVar

from stallfree.operator.router.pick import AffinityMargin, Choice, ReplicaView

K = TypeVar("K", bound=Hashable)

# Without a queue-wait SLO: dispatch while a replica's queued prefill drains within this long.
DEFAULT_DISPATCH_WAIT_MS = 500.0
# The share of the queue-wait SLO a request may wait on its replica once dispatched (the rest is the router's).
SLO_SHARE = 0.25


# A tenant's offered prompt tokens in its band are counted over this long, and it is flooding past this many times
# its fair share of the band's (the band's over its tenants).
TENANT_MEMORY_S = 10.0
FLOOD_SHARE = 2.0


def dispatch_wait_ms(queue_wait_slo_ms: float | None) -> float:
    return DEFAULT_DISPATCH_WAIT_MS if not queue_wait_slo_ms else SLO_SHARE * queue_wait_slo_ms


@dataclass(frozen=True)
class FlowConfig:
    dispatch_wait_ms: float = DEFAULT_DISPATCH_WAIT_MS
    max_queued: int = 1024  # requests waiting at most; past it, refused (429)
    # A request waits for the replica predicted to start it soonest only when it beats every replica that
    # could take it now by more than this (max(50 ms, 25%)).
    hold_margin: AffinityMargin = AffinityMargin()


@dataclass
class Queued(Generic[K]):
    key: K
    arrival_s: float
    prompt_tokens: int
    exclude: frozenset[str] = frozenset()  # replicas that already failed this request (tried first elsewhere)
    objective: str = ""
    priority: int = 0  # higher bands go first
    tenant: str = ""  # fairness between tenants within a band
    deadline_s: float | None = None  # None: arrival order within the tenant
    seq: int = 0  # set by push: arrival order; a retry (front) keeps a place before every arrival
    demoted: bool = False  # set by dispatch: its tenant is flooding its band, sent one below it (`sent_priority`)
    sequences: int = 1  # `n`: the running slots it takes on its replica

    @property
    def sent_priority(self) -> int:
        """The priority it is sent (and signed to the engine) with: its band's, one lower when its tenant floods."""
        return self.priority - 1 if self.demoted else self.priority


def admits(view: ReplicaView, config: FlowConfig, priority: int | None = None, sequences: int = 1) -> bool:
    """Can this replica start one more request (of `priority`: only what is ahead of that band counts; running
    `sequences` choices) soon? An idle replica always can."""
    if priority is not None:
        view = view.seen_by(priority)
    if not view.has_slots(sequences):
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
    _pushes: int = 0
    _served_at: dict[str, int] = field(default_factory=dict)  # tenant -> the dispatch count when last served
    _offers: "deque[tuple[float, int, str, int]]" = field(default_factory=deque)  # (arrival, band, tenant, tokens)
    _offered: dict[tuple[int, str], int] = field(default_factory=dict)  # (band, tenant) -> tokens in _offers
    _held: dict[tuple[int, str], int] = field(default_factory=dict)  # (band, tenant) -> requests waiting here
    # Kept as requests come and go, so that the gauges read per arrival cost nothing with thousands waiting.
    _tokens: int = 0
    _by_objective: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Queued[K]]:
        return iter(self._waiting.values())

    @property
    def queued_prompt_tokens(self) -> int:
        return self._tokens

    def oldest_arrival_s(self) -> float | None:
        return min((q.arrival_s for q in self._waiting.values()), default=None)

    def depth_by_objective(self) -> dict[str, int]:
        return dict(self._by_objective)

    def ordered(self) -> list[Queued[K]]:
        """The waiting requests in the order they are offered to the replicas (the module's docstring)."""
        waiting = list(self._waiting.values())
        if all(q.priority == 0 and not q.tenant and q.deadline_s is None for q in waiting):
            return waiting  # one band, one tenant, no deadlines: arrival order (a retry at the front)
        bands: dict[int, dict[str, list[Queued[K]]]] = {}
        for q in waiting:
            bands.setdefault(q.priority, {}).setdefault(q.tenant, []).append(q)
        out: list[Queued[K]] = []
        for priority in sorted(bands, reverse=True):
            tenants = bands[priority]
            for items in tenants.values():
                items.sort(key=lambda q: (q.deadline_s if q.deadline_s is not None else float("-inf"), q.seq))
            turn = sorted(tenants, key=lambda t: (self._served_at.get(t, -1), tenants[t][0].seq))
            for depth in range(max(len(items) for items in tenants.values())):
                out.extend(tenants[t][depth] for t in turn if depth < len(tenants[t]))
        return out

    def push(self, item: Queued[K], front: bool = False) -> bool:
        """Queue a request; False (refused) when the queue is full or its flow holds its share of it (`share`).
        `front`: a retry keeps its place."""
        if not front and (item.tenant or self._offers):
            self._offer(item)
        if not front and (len(self._waiting) >= self.config.max_queued
                          or self._held.get(_flow(item), 0) >= self.share(item)):
            self.rejected += 1
            return False
        if not front:
            self.arrivals += 1  # a refused one is no arrival: demand counts what was taken in
        self._pushes += 1
        item.seq = -self._pushes if front else self._pushes
        self._waiting[item.key] = item
        self._held[_flow(item)] = self._held.get(_flow(item), 0) + 1
        self._tokens += item.prompt_tokens
        self._by_objective[item.objective] = self._by_objective.get(item.objective, 0) + 1
        if front:
            self._waiting.move_to_end(item.key, last=False)
        return True

    def share(self, item: Queued[K]) -> int:
        """How many requests its flow (band and tenant) may hold here: the queue's bound over the flows seen lately
        (offering in the last TENANT_MEMORY_S, or waiting), so one flooding flow fills its share, not the queue,
        and the others' requests still find room. One flow: the whole queue."""
        flows = {*self._offered, *self._held, _flow(item)}
        return max(1, self.config.max_queued // len(flows))

    def cancel(self, key: K) -> bool:
        """A client that left while queued: removed, counted as cancelled."""
        item = self._waiting.pop(key, None)
        if item is None:
            return False
        self._release(item)
        self.cancelled += 1
        return True

    def _release(self, item: Queued[K]) -> None:
        flow = _flow(item)
        left = self._held[flow] - 1
        if left:
            self._held[flow] = left
        else:
            del self._held[flow]
        self._tokens -= item.prompt_tokens
        left = self._by_objective[item.objective] - 1
        if left:
            self._by_objective[item.objective] = left
        else:
            del self._by_objective[item.objective]

    def dispatch(self, views: list[ReplicaView],
                 choose: Callable[[Queued[K], list[ReplicaView]], Choice]) -> list[tuple[Queued[K], Choice]]:
        """Send the waiting requests, in arrival order, that their best replica can start soon.

        `views` are the healthy replicas; `choose` is the routing policy (the slo-aware one picks the
        lowest predicted TTFT, backlog included). Each waiting request, oldest first, is placed on the
        replica `choose` picks among all of them, as immediate dispatch would place it; it is sent only if
        that replica admits it now, or another that admits now is predicted within the hold margin of it
        (predictions are estimates: waiting for a replica only a little better by them leaves this one
        idle); otherwise it waits here, still counted on that replica's backlog so that the requests behind
        it see it. So a long prompt waits for a fast replica rather than taking the first slow one that
        frees, no request waits behind a later one for the same replica, and every decision is taken again
        at the next dispatch: a replica that became ready, or drains faster than
        predicted, takes the backlog at once. Each send counts on the real view too, so one call spreads
        a backlog over the replicas as their state would be after each send.
        """
        out: list[tuple[Queued[K], Choice]] = []
        if not self._waiting or not self._any_admits(views):
            self._forget_served()
            return out  # the common case under a flood: every replica full, the queue is not walked at all
        real = {v.name: v for v in views}  # what each replica holds: decides whether it admits now
        placed = dict(real)  # plus what waits here for it: what the policy sees
        flooding = self._flooding()
        blocked_at: int | None = None  # a band no replica admits: neither does any lower one
        for item in self.ordered():
            # A flooding tenant goes one below its band: the other tenants' requests are never held behind it.
            item.demoted = (item.priority, item.tenant) in flooding
            p = item.sent_priority
            if blocked_at is not None and p <= blocked_at:
                continue
            if not any(admits(v, self.config, p, item.sequences) for v in real.values()):
                blocked_at = p if blocked_at is None else max(blocked_at, p)
                continue  # nothing more of this band can go anywhere

            def admitted(v: ReplicaView) -> bool:
                return admits(v, self.config, p, item.sequences)

            # A replica whose running slots (those of this band or higher) are all taken starts nothing until one
            # frees, which its queued prefill does not show: it is chosen only when every replica is so.
            seen = {name: v.seen_by(p) for name, v in placed.items()}
            open_slots = [v for v in seen.values() if v.has_slots(item.sequences)]
            pool = open_slots or list(seen.values())
            preferred = [v for v in pool if v.name not in item.exclude]
            candidates = preferred or pool
            choice = choose(item, candidates)
            if not admitted(real[choice.name]):
                choice = self._instead(item, choice, candidates, real, choose, admitted) or choice
            if admitted(real[choice.name]):
                del self._waiting[item.key]
                self._release(item)
                self.dispatched += 1
                self._served_at[item.tenant] = self.dispatched
                out.append((item, choice))
                real[choice.name] = real[choice.name].plus(item.prompt_tokens, p, item.tenant, item.sequences)
            placed[choice.name] = placed[choice.name].plus(item.prompt_tokens, p, item.tenant, item.sequences)
        self._forget_served()
        return out

    def _forget_served(self) -> None:
        """The fairness memory holds only tenants still waiting (bounded by them); one who returns starts afresh."""
        waiting_tenants = {tenant for _, tenant in self._held}
        for tenant in [t for t in self._served_at if t not in waiting_tenants]:
            del self._served_at[tenant]

    def _any_admits(self, views: list[ReplicaView]) -> bool:
        """Whether some replica admits a one-sequence request of the highest band waiting (none admitting it, none
        admits anything waiting: a lower band sees more ahead of it). O(replicas + flows)."""
        top = max(priority for priority, _ in self._held)
        return any(admits(v, self.config, top) for v in views)

    def _offer(self, item: Queued[K]) -> None:
        """Count its prompt in its tenant's offer over the last TENANT_MEMORY_S (by arrival times)."""
        offers, offered = self._offers, self._offered
        offers.append((item.arrival_s, item.priority, item.tenant, item.prompt_tokens))
        key = (item.priority, item.tenant)
        offered[key] = offered.get(key, 0) + item.prompt_tokens
        horizon = item.arrival_s - TENANT_MEMORY_S
        while offers and offers[0][0] < horizon:
            _, priority, tenant, tokens = offers.popleft()
            left = offered[(priority, tenant)] - tokens
            if left > 0:
                offered[(priority, tenant)] = left
            else:
                del offered[(priority, tenant)]

    def _flooding(self) -> set[tuple[int, str]]:
        """(band, tenant) of the tenants that offered more than FLOOD_SHARE times their band's fair share lately."""
        bands: dict[int, list[tuple[str, int]]] = {}
        for (priority, tenant), tokens in self._offered.items():
            bands.setdefault(priority, []).append((tenant, tokens))
        out: set[tuple[int, str]] = set()
        for priority, tenants in bands.items():
            if len(tenants) > 1:
                fair = sum(tokens for _, tokens in tenants) / len(tenants)
                out.update((priority, t) for t, tokens in tenants if tokens > FLOOD_SHARE * fair)
        return out

    def _instead(self, item: Queued[K], best: Choice, candidates: list[ReplicaView], real: dict[str, ReplicaView],
                 choose: Callable[[Queued[K], list[ReplicaView]], Choice],
                 admitted: Callable[[ReplicaView], bool]) -> Choice | None:
        """A replica that admits now, when waiting for the best one would not clearly pay: its predicted TTFT is
        within the hold margin of the best's (predictions are estimates: holding a request for a replica only
        a little better by them leaves this one idle), or the policy predicts nothing."""
        admitting = [v for v in candidates if admitted(real[v.name])]
        if not admitting:
            return None
        alternative = choose(item, admitting)
        if best.predicted_ttft_ms is None or alternative.predicted_ttft_ms is None:
            return alternative
        return alternative if self.config.hold_margin.allows(alternative.predicted_ttft_ms,
                                                             best.predicted_ttft_ms) else None


def _flow(item: Queued[K]) -> tuple[int, str]:
    return item.priority, item.tenant
