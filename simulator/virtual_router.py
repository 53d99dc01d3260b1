"""The router in virtual time, knowing what the real one knows: its flow control, pick and prefill clock.

Arrivals wait in one queue per service; every `tick_s` of virtual time while anything waits (the real
router re-checks on each stats poll and whenever a request's prefill finishes or a slot frees), the
oldest requests go to the replicas that can start them soon, each to the one with the lowest predicted
TTFT (pick.py's slo-aware rule, without prefix affinity: simulated prompts share no prefix). A request
keeps its router arrival time on the replica, so the replica's queue wait and TTFT count from it.

Every rule is production's: arrivals, shedding, the queue's order, dispatch, the reservation on a replica,
the objective signed to its engine and the settling by first tokens and ends are the proxy's waiting room
(operator/router/waiting_room.py), driven here on virtual time. What a replica has queued is never read off its
scheduler: each replica is the router's own `Replica` (replicas.py). First tokens and ends reach the router
through an engine observer (`observer(name)`), and count only once the router's clock has passed them. What
became of each request is also kept (request_outcomes.py): the run's goodput, as its clients saw it. The control
loop reads the router as the operator reads production's: `/router/queue` (the waiting room's status) through
observe_router.py.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Sequence

from stallfree.contracts import Profile
from stallfree.node_daemon.engine.request import Objective, Request
from stallfree.operator.control.observe import QueueObservation
from stallfree.operator.control.observe_router import RouterQueueSource
from stallfree.operator.router.flow_control import FlowConfig, Queued
from stallfree.operator.router.objectives import Objectives
from stallfree.operator.router.pick import ReplicaView, pick
from stallfree.operator.router.replicas import Replica
from stallfree.operator.router.startup_times import StartupTimes
from stallfree.operator.router.waiting_room import QueueFull, WaitingRoom
from stallfree.simulator.request_outcomes import REFUSED, SHED, Outcomes
from stallfree.simulator.virtual_replica import VirtualReplica

# How often the router's view of a replica's speed is refreshed (its /admin/stats poll, coarser in virtual
# time: the window's calibration moves slowly).
STATS_REFRESH_S = 2.0

_FIRST_TOKEN, _ENDED = 0, 1


class _Replies:
    """What the router hears back from one replica's requests: first tokens and ends, with their times."""

    def __init__(self, router: "VirtualRouter", name: str) -> None:
        self.router, self.name = router, name

    def on_iteration(self, record) -> None:
        pass

    def on_token(self, request: Request, now: float, first: bool) -> None:
        if first:
            self.router._heard(now, self.name, request.request_id, _FIRST_TOKEN)

    def on_finished(self, request: Request, now: float) -> None:
        self.router._heard(now, self.name, request.request_id, _ENDED)


class VirtualRouter:
    def __init__(self, flow: FlowConfig, profile_of: Callable[[str], Profile], window_s: float,
                 tick_s: float = 0.05, objectives: Objectives | None = None, now: float = 0.0) -> None:
        self.room: WaitingRoom[int] = WaitingRoom(flow, objectives)  # production's rules
        self.queue = self.room.queue
        self.outcomes = Outcomes(self.room.objectives)
        self.startup_times = StartupTimes()  # the start-ups seen (replica_started): when a starting one is ready
        self.profile_of = profile_of
        self.tick_s = tick_s
        self._requests: dict[int, tuple[int, int]] = {}  # key -> (prompt_len, max_tokens)
        self._next = 0
        self.replicas: dict[str, Replica] = {}  # what the router knows of each: stats, profile, clock, in flight
        self._polled: dict[str, float] = {}  # when each one's stats were last read
        self._sent: dict[str, dict[str, tuple[int, int]]] = {}  # each one's request ids in flight -> (ticket, key)
        self._replies: list[tuple[float, int, str, str, int]] = []  # heap: (time, seq, replica, request, kind)
        self._seq = itertools.count()
        self._readings = RouterQueueSource(None, window_s)  # the operator's reading of /router/queue
        self._readings.take(self.room.status(now), now)  # read since the router started, as the operator does

    def observer(self, name: str) -> _Replies:
        """The engine observer a replica named `name` reports its first tokens and ends to (pass it at build)."""
        return _Replies(self, name)

    def replica_started(self, seconds: float) -> None:
        """A replica became ready `seconds` after it was asked for (as the router sees a start-up end)."""
        self.startup_times.observed(seconds)

    @property
    def objectives(self) -> Objectives:
        return self.room.objectives

    def use_objectives(self, objectives: Objectives) -> None:
        """The service's objectives (the operator's `--objectives`); before any request arrives."""
        self.room.objectives = objectives
        self.outcomes = Outcomes(objectives)

    def arrive(self, t: float, prompt_len: int, max_tokens: int, objective: str = "", tenant: str = "",
               ready: dict[str, VirtualReplica] | None = None, starting: Sequence[float] = ()) -> bool:
        """A request at the router: queued, or refused (the queue is full, or it is shed: `ready` are the
        replicas that could take it, `starting` how long each replica asked for and not yet ready has been
        starting, in seconds). An objective the service does not define is a ValueError (the router's 400: a
        workload naming one is wrong)."""
        named = self.objectives.named(objective)
        if named is None:
            raise ValueError(f"objective {objective!r} is not one of {', '.join(self.objectives.names())}")
        self._next += 1
        starting_in_ms = [ms for ms in map(self.startup_times.ready_in_ms, starting) if ms is not None]
        views = lambda: [self._known(name, replica, t).view(t) for name, replica in (ready or {}).items()]  # noqa: E731
        item = self.room.arrive(self._next, named, tenant, prompt_len, t, views, starting_in_ms)
        if not isinstance(item, Queued):
            self.outcomes.refused(t, named.name, tenant, prompt_len, REFUSED if isinstance(item, QueueFull) else SHED)
            return False  # the router's 429
        self._requests[self._next] = (prompt_len, max_tokens)
        self.outcomes.arrived(self._next, t, named.name, tenant, prompt_len, max_tokens)
        return True

    def dispatch(self, now: float, replicas: dict[str, VirtualReplica]) -> int:
        """Send what the replicas can start soon; returns how many went."""
        self._hear_until(now)
        if not len(self.queue) or not replicas:
            return 0
        views = [self._known(name, replica, now).view(now) for name, replica in replicas.items()]

        def choose(item: Queued[int], candidates: list[ReplicaView]):
            return pick("slo-aware", candidates, item.prompt_tokens, item.key)

        sent = self.room.dispatch(views, choose, now)
        for item, choice in sent:
            prompt_len, max_tokens = self._requests.pop(item.key)
            named = self.room.objectives.by_name[item.objective]
            signed = self.room.signed(named, item.sent_priority, item.arrival_s)  # on the engine's (virtual) clock
            engine_objective = None if signed is None else \
                Objective(signed.name, signed.priority, signed.deadline_s, signed.tpot_ms)
            request_id = replicas[choice.name].submit(prompt_len, max_tokens, item.arrival_s,
                                                      objective=engine_objective)
            ticket = self.room.reserve(self.replicas[choice.name], prompt_len, now, item.sent_priority, item.tenant,
                                       named, item.arrival_s)
            self._sent.setdefault(choice.name, {})[request_id] = (ticket, item.key)
            self.outcomes.dispatched(item.key, now)
        return len(sent)

    def snapshot(self, now: float) -> QueueObservation:
        """What the router's queue shows the control loop: its `/router/queue` as the operator reads it."""
        return self._readings.take(self.room.status(now), now)

    def forget(self, names: Sequence[str]) -> None:
        """Replicas that left or restarted: what was in flight there failed, and a new process starts afresh."""
        gone = set(names)
        for name in gone:
            self.replicas.pop(name, None)
            self._polled.pop(name, None)
            for ticket, key in self._sent.pop(name, {}).values():
                self.room.lost(ticket)
                self.outcomes.lost(key)
        if gone:
            self._replies = [reply for reply in self._replies if reply[2] not in gone]
            heapq.heapify(self._replies)

    # -- as the proxy does --------------------------------------------------------------------------------
    def _known(self, name: str, replica: VirtualReplica, now: float) -> Replica:
        """The router's record of a replica, its stats re-read every STATS_REFRESH_S (the poll)."""
        known = self.replicas.get(name)
        if known is None:
            known = self.replicas[name] = Replica(name, url=f"virtual://{name}", healthy=True, reason="ready",
                                                  profile=self.profile_of(name))
        if known.stats is None or now - self._polled[name] >= STATS_REFRESH_S:
            known.stats = replica.window_stats(now)
            self._polled[name] = now
        return known

    def _heard(self, t: float, name: str, request_id: str, kind: int) -> None:
        if request_id not in self._sent.get(name, ()):
            return  # not sent by this router (or its replica restarted since)
        heapq.heappush(self._replies, (t, next(self._seq), name, request_id, kind))

    def _hear_until(self, now: float) -> None:
        """First tokens settle the clock (the proxy's first byte); an end frees a slot (its release). A replica's
        iteration may end past `now`: what it reported then waits until the router's time reaches it."""
        replies = self._replies
        while replies and replies[0][0] <= now:
            t, _, name, request_id, kind = heapq.heappop(replies)
            known, sent = self.replicas.get(name), self._sent.get(name)
            if known is None or sent is None or request_id not in sent:
                continue  # its replica restarted since
            ticket, key = sent[request_id]
            if kind == _FIRST_TOKEN:
                self.room.first_byte(known, ticket, t)
                self.outcomes.first_token(key, t)
            else:
                self.outcomes.ended(key, t)
                del sent[request_id]
                self.room.release(known, ticket, t)
