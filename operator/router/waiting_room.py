"""The router's waiting room: the rules a generation request meets from its arrival to its answer. Clock-free:
every time is passed in, none is read here.

- arrive: counted as offered, shed (a sheddable objective predicted to miss its TTFT target everywhere:
  shedding.py), refused (its flow's share of the queue is full: flow_control.py) or queued with its deadline;
- dispatch: the queue hands waiting requests to the replicas that can start them soon (flow_control.py);
- reserve: counted on its replica at dispatch, in flight there and on its prefill clock (prefill_clock.py);
- sign: what the replica's engine is told of the request's objective (request_objective_header);
- settle: its first byte settles the prefill clock and its outcome (objective_outcomes.py); its end, or a
  failure, gives the reservation back;
- status: what `/router/queue` shows the control loop.

The HTTP proxy (proxy.py) drives it on the process's clock; the simulator's router (simulator/virtual_router.py)
on virtual time, so both run these very rules.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Generic, Sequence, TypeVar

from stallfree.operator.router.flow_control import FlowConfig, FlowQueue, Queued
from stallfree.operator.router.objective_outcomes import ObjectiveOutcomes
from stallfree.operator.router.objectives import Objective, Objectives, deadline_s
from stallfree.operator.router.pick import Choice, ReplicaView
from stallfree.operator.router.replicas import Replica
from stallfree.operator.router.shedding import BandArrivals, backlog_drain_ms, sheds
from stallfree.request_objective_header import RequestObjective

K = TypeVar("K")


@dataclass(frozen=True)
class Shed:
    """Refused at arrival: predicted to miss its TTFT target at every replica (the 429 shed_predicted_miss)."""

    predicted_ms: float
    backlog_drain_ms: float = 0.0  # when the backlog there is now will have drained: its Retry-After


@dataclass(frozen=True)
class QueueFull:
    """Refused at arrival: the queue, or its flow's share of it, is full (the 429 queue_full)."""

    share: int | None  # the flow's share when that refused it; None: the whole queue was full
    backlog_drain_ms: float = 0.0  # when the queue there is now will have drained: its Retry-After


class WaitingRoom(Generic[K]):
    def __init__(self, flow: FlowConfig, objectives: Objectives | None = None) -> None:
        self.flow = flow
        self.queue: FlowQueue[K] = FlowQueue(flow)
        self.objectives = objectives or Objectives.implicit()
        # Per objective: requests and prompt tokens offered (shed ones too: the control loop sizes from them),
        # shed, and outcomes (objective_outcomes.py); each band's recent arrivals, the reserve shedding predicts with.
        self.offered_requests: Counter[str] = Counter()
        self.offered_tokens: Counter[str] = Counter()
        self.shed: Counter[str] = Counter()
        self.outcomes = ObjectiveOutcomes()
        self.bands = BandArrivals()
        self.arrived_prompt_tokens = 0  # counters: the control loop takes their rates between two reads
        self.arrived_prompt_tokens_sq = 0  # and of the squares: the spread of prompt lengths (queueing.py)
        # Arrivals a replica then refused at once (a 4xx other than 429: a prompt past the context, a value out of
        # range): counted apart, so demand is what the replicas accepted and junk buys no replica.
        self.refused = 0
        self.refused_prompt_tokens = 0
        self.refused_prompt_tokens_sq = 0
        self._tickets = itertools.count(1)
        self._judged: dict[int, tuple[Objective, float, float]] = {}  # ticket -> (objective, arrival, dispatch)

    def arrive(self, key: K, objective: Objective, tenant: str, prompt_tokens: int, arrival_s: float,
               views: Callable[[], Sequence[ReplicaView]], starting_in_ms: Sequence[float] = (),
               exclude: frozenset[str] = frozenset(), front: bool = False,
               sequences: int = 1) -> Queued[K] | Shed | QueueFull:
        """A request at the router: queued (its `Queued`), shed or refused. `views`: the ready replicas as the router
        sees them now (read only when the objective needs them); `starting_in_ms`: when each replica starting is
        expected ready. `front`: a retry after a replica failed it, queued first and not counted again."""
        seen = list(views()) if objective.sheddable or objective.ttft_ms is not None else []
        if not front:
            self.offered_requests[objective.name] += 1
            self.offered_tokens[objective.name] += prompt_tokens
            self.bands.offered(arrival_s, objective.priority, prompt_tokens)
            if objective.sheddable:
                ahead = sum(q.prompt_tokens for q in self.queue if q.priority >= objective.priority)
                reserve = self.bands.reserve(objective.priority, arrival_s, (objective.ttft_ms or 0.0) / 1000.0)
                predicted = sheds(objective, seen, starting_in_ms, prompt_tokens, ahead, reserve)
                if predicted is not None:
                    self.shed[objective.name] += 1
                    return Shed(predicted, backlog_drain_ms(seen, ahead))
        fastest = max((v.prefill_tokens_per_ms for v in seen), default=None)
        item = Queued(key, arrival_s, prompt_tokens, exclude, objective=objective.name, priority=objective.priority,
                      tenant=tenant, deadline_s=deadline_s(objective, prompt_tokens, arrival_s, fastest),
                      sequences=sequences)
        if not self.queue.push(item, front=front):
            self.outcomes.unserved(objective.name)
            whole = len(self.queue) >= self.flow.max_queued
            drain = backlog_drain_ms(list(seen or views()), self.queue.queued_prompt_tokens)
            return QueueFull(None if whole else self.queue.share(item), drain)
        if not front:
            self.arrived_prompt_tokens += prompt_tokens
            self.arrived_prompt_tokens_sq += prompt_tokens ** 2
        return item

    def dispatch(self, views: list[ReplicaView], choose: Callable[[Queued[K], list[ReplicaView]], Choice],
                 now: float) -> list[tuple[Queued[K], Choice]]:
        """The waiting requests the replicas (`views`, the healthy ones) can start soon, each with its replica."""
        sent = self.queue.dispatch(views, choose)
        for item, _ in sent:
            self.outcomes.dispatched(item.objective, now, (now - item.arrival_s) * 1000.0)
        return sent

    def reserve(self, replica: Replica, prompt_tokens: int, now: float, priority: int = 0, tenant: str = "",
                objective: Objective | None = None, arrival_s: float | None = None, sequences: int = 1) -> int:
        """Counted on `replica` at dispatch (in its band), before the request is sent: the next dispatch sees it.
        A generation request names its `objective` and router arrival: its first byte is judged by them. Returns
        the ticket its first byte (`first_byte`) and its end (`release`) settle."""
        ticket = next(self._tickets)
        if objective is not None:
            self._judged[ticket] = (objective, now if arrival_s is None else arrival_s, now)
        replica.outstanding += sequences  # n choices hold n running slots
        replica.held[ticket] = priority
        if sequences != 1:
            replica.sequences[ticket] = sequences
        replica.clock.dispatched(ticket, prompt_tokens, replica.prefill_tokens_per_ms() * 1000.0, now, priority,
                                 tenant)
        return ticket

    def signed(self, objective: Objective, sent_priority: int, arrival_s: float) -> RequestObjective | None:
        """What the engine is told: the priority it was sent with (one below its band past its tenant's share:
        flow_control.py), its first token due at its arrival plus the TTFT target (on the clock `arrival_s` is
        on), its TPOT target. Sent below its band it gives up its deadline, which would let it take budget beside
        the band. None for a request of the service's only objective sent at priority 0: every request is alike,
        nothing orders one before another, so the engine keeps first come, first served at the tuner's budget
        (its deadline and TPOT target only ever order one objective against another); one sent below its band is
        signed, so it goes after them."""
        if len(self.objectives.by_name) == 1 and sent_priority == 0:
            return None
        if sent_priority != objective.priority:
            objective = replace(objective, priority=sent_priority, ttft_ms=None)
        deadline = None if objective.ttft_ms is None else arrival_s + objective.ttft_ms / 1000.0
        return RequestObjective(objective.name, objective.priority, deadline, objective.tpot_ms)

    def first_byte(self, replica: Replica, ticket: int, now: float, status: int = 200) -> None:
        """Its first byte came back: its prefill is done (the replica may take the next one) and a generation
        request is judged (objective_outcomes.good: its TTFT and queue wait, from its arrival here) by the status
        the replica answered: an answer by its times; a 5xx or 429 (the service failed it, however fast) judged
        and not good; any other 4xx (the request's own fault: a malformed body, a prompt past the model) not
        judged at all, as a request refused by the router's own door is not."""
        replica.clock.prefilled(ticket, now)
        judged = self._judged.pop(ticket, None)
        if judged is None or client_error(status):
            return
        objective, arrival_s, dispatched_s = judged
        if status >= 400:
            self.outcomes.unserved(objective.name)
        else:
            self.outcomes.first_byte(objective, now, (now - arrival_s) * 1000.0, (dispatched_s - arrival_s) * 1000.0)

    def refused_by_replica(self, prompt_tokens: int) -> None:
        """A request counted at its arrival that its replica refused at once: taken back out of demand."""
        self.refused += 1
        self.refused_prompt_tokens += prompt_tokens
        self.refused_prompt_tokens_sq += prompt_tokens ** 2

    def unserved(self, objective: Objective) -> None:
        """A request queued here and answered without a replica (timed out, none could take it): judged, not
        good."""
        self.outcomes.unserved(objective.name)

    def lost(self, ticket: int) -> None:
        """Its replica went away (the reservation goes with it): before its first byte it is judged, not good."""
        judged = self._judged.pop(ticket, None)
        if judged is not None:
            self.outcomes.unserved(judged[0].name)

    def release(self, replica: Replica, ticket: int, now: float) -> None:
        """Its answer ended, or it failed, or it was given back: its slot frees (before its first byte, its share of
        the prefill clock goes too)."""
        replica.outstanding -= replica.sequences.pop(ticket, 1)
        replica.held.pop(ticket, None)
        replica.clock.forget(ticket, now)
        self._judged.pop(ticket, None)  # failed before its first byte: a retry, or `unserved`, judges it

    def status(self, now: float) -> dict:
        """`/router/queue`: the queue now, its counters and each objective's figures (observe_router.py reads it)."""
        queue, oldest, depths = self.queue, self.queue.oldest_arrival_s(), self.queue.depth_by_objective()
        return {"depth": len(queue), "queued_prompt_tokens": queue.queued_prompt_tokens,
                "oldest_wait_ms": 0.0 if oldest is None else max(0.0, now - oldest) * 1000.0,
                "arrivals": queue.arrivals, "arrived_prompt_tokens": self.arrived_prompt_tokens,
                "arrived_prompt_tokens_sq": self.arrived_prompt_tokens_sq, "refused_by_replica": self.refused,
                "refused_prompt_tokens": self.refused_prompt_tokens,
                "refused_prompt_tokens_sq": self.refused_prompt_tokens_sq,
                "rejected": queue.rejected, "cancelled": queue.cancelled, "dispatched": queue.dispatched,
                "max_queued": self.flow.max_queued, "dispatch_wait_ms": self.flow.dispatch_wait_ms,
                "objectives": {o.name: {"priority": o.priority, "ttft_ms": o.ttft_ms, "depth": depths.get(o.name, 0),
                                        "shed": self.shed[o.name], "offered": self.offered_requests[o.name],
                                        "offered_prompt_tokens": self.offered_tokens[o.name],
                                        **self.outcomes.figures(o.name, now)}
                               for o in self.objectives.by_name.values()}}


def client_error(status: int) -> bool:
    """A 4xx other than 429: the request's own fault, which says nothing of the service."""
    return 400 <= status < 500 and status != 429
