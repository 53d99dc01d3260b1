"""The router in virtual time, knowing what the real one knows: its flow control, pick and prefill clock.

Arrivals wait in one queue per service; every `tick_s` of virtual time while anything waits (the real
router re-checks on each stats poll and whenever a request's prefill finishes or a slot frees), the
oldest requests go to the replicas that can start them soon, each to the one with the lowest predicted
TTFT (pick.py's slo-aware rule, without prefix affinity: simulated prompts share no prefix). A request
keeps its router arrival time on the replica, so the replica's queue wait and TTFT count from it.

Each request names an objective and a tenant (objectives.py): its priority band, its tenant's turn and its
deadline order it in the queue (flow_control.py, as the proxy builds its `Queued`), and a request of a sheddable
objective predicted to miss its TTFT target at every ready replica, counting the replicas starting, is refused
at arrival (shedding.py, the proxy's 429). What became of each request is kept (request_outcomes.py): its
objective's windows for the control loop, and the run's goodput.

What a replica has queued is never read off its scheduler: each replica is the router's own `Replica`
(replicas.py), whose `PrefillClock` is charged at dispatch and settled by each request's first token, as
the proxy does with first bytes. First tokens and ends reach the router through an engine observer
(`observer(name)`), and count only once the router's clock has passed them.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Sequence

from stallfree.contracts import Profile
from stallfree.node_daemon.engine.request import Objective, Request
from stallfree.operator.control.observe import QueueObservation
from stallfree.operator.control.queueing import prompt_cv2
from stallfree.operator.router.flow_control import FlowConfig, FlowQueue, Queued
from stallfree.operator.router.objectives import Objectives, deadline_s
from stallfree.operator.router.pick import ReplicaView, pick
from stallfree.operator.router.replicas import Replica
from stallfree.operator.router.shedding import BandArrivals, sheds
from stallfree.operator.router.startup_times import StartupTimes
from stallfree.simulator.request_outcomes import Outcomes
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
                 tick_s: float = 0.05, objectives: Objectives | None = None) -> None:
        self.queue: FlowQueue[int] = FlowQueue(flow)
        self.objectives = objectives or Objectives.implicit()
        self.outcomes = Outcomes(self.objectives)
        self.bands = BandArrivals(window_s)  # what each priority band offered: the reserve shedding predicts with
        self.startup_times = StartupTimes()  # the start-ups seen (replica_started): when a starting one is ready
        self.profile_of = profile_of
        self.window_s = window_s
        self.tick_s = tick_s
        self._requests: dict[int, tuple[int, int]] = {}  # key -> (prompt_len, max_tokens)
        self._keys: dict[str, int] = {}  # request id on its replica -> the router's key
        self._next = 0
        self.replicas: dict[str, Replica] = {}  # what the router knows of each: stats, profile, clock, in flight
        self._polled: dict[str, float] = {}  # when each one's stats were last read
        self._sent: dict[str, set[str]] = {}  # request ids sent to each and not ended
        self._replies: list[tuple[float, int, str, str, int]] = []  # heap: (time, seq, replica, request, kind)
        self._seq = itertools.count()
        self._arrived: list[tuple[float, int]] = []  # (time, prompt tokens) over the last window
        self._last_snapshot: float | None = None

    def observer(self, name: str) -> _Replies:
        """The engine observer a replica named `name` reports its first tokens and ends to (pass it at build)."""
        return _Replies(self, name)

    def replica_started(self, seconds: float) -> None:
        """A replica became ready `seconds` after it was asked for (as the router sees a start-up end)."""
        self.startup_times.observed(seconds)

    def use_objectives(self, objectives: Objectives) -> None:
        """The service's objectives (the operator's `--objectives`); before any request arrives."""
        self.objectives = objectives
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
        self._arrived.append((t, prompt_len))
        self.bands.offered(t, named.priority, prompt_len)
        needs_views = ready is not None and (named.sheddable or named.ttft_ms is not None)
        views = [self._known(name, replica, t).view(t) for name, replica in (ready or {}).items()] \
            if needs_views else []
        if named.sheddable and ready is not None:
            ahead = sum(q.prompt_tokens for q in self.queue if q.priority >= named.priority)
            reserved = self.bands.reserve(named.priority, t, (named.ttft_ms or 0.0) / 1000.0)
            starting_in_ms = [ms for ms in map(self.startup_times.ready_in_ms, starting) if ms is not None]
            if sheds(named, views, starting_in_ms, prompt_len, ahead, reserved) is not None:
                self.outcomes.shed(t, named.name, tenant, prompt_len)
                return False
        fastest = max((v.prefill_tokens_per_ms for v in views), default=None)
        item = Queued(self._next, t, prompt_len, objective=named.name, priority=named.priority, tenant=tenant,
                      deadline_s=deadline_s(named, prompt_len, t, fastest))
        if not self.queue.push(item):
            self.outcomes.refused(t, named.name, tenant, prompt_len)
            return False  # counted by the queue (rejected), as the router answers 429
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

        sent = self.queue.dispatch(views, choose)
        for item, choice in sent:
            prompt_len, max_tokens = self._requests.pop(item.key)
            request_id = replicas[choice.name].submit(prompt_len, max_tokens, item.arrival_s,
                                                      objective=self._signed(item))
            self._reserve(choice.name, request_id, prompt_len, now, item.sent_priority, item.tenant)
            self._keys[request_id] = item.key
            self.outcomes.dispatched(item.key, now)
        return len(sent)

    def snapshot(self, now: float) -> QueueObservation:
        """What the router's queue shows the control loop (the real router's /router/queue, read as rates)."""
        horizon = now - self.window_s
        self._arrived = [(t, n) for t, n in self._arrived if t > horizon]
        oldest = self.queue.oldest_arrival_s()
        last, self._last_snapshot = self._last_snapshot, now
        recent = [n for t, n in self._arrived if last is not None and t > last]
        span = min(self.window_s, max(now, 1e-9))
        lengths = [n for _, n in self._arrived]
        several = len(self.objectives.by_name) > 1  # one objective: the queue's own figures say it all
        windows = self.outcomes.windows(now, self.window_s, last, list(self.queue)) if several else ()
        return QueueObservation(len(self.queue), self.queue.queued_prompt_tokens,
                                0.0 if oldest is None else max(0.0, now - oldest) * 1000.0,
                                sum(lengths) / span, sum(recent), len(recent), 0.0 if last is None else now - last,
                                arrival_requests_per_s=len(lengths) / span,
                                prompt_cv2=prompt_cv2(len(lengths), sum(lengths), sum(n * n for n in lengths)),
                                objectives=windows)

    def forget(self, names: Sequence[str]) -> None:
        """Replicas that left or restarted: what was in flight there failed, and a new process starts afresh."""
        gone = set(names)
        for name in gone:
            self.replicas.pop(name, None)
            self._polled.pop(name, None)
            for request_id in self._sent.pop(name, ()):
                key = self._keys.pop(request_id, None)
                if key is not None:
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

    def _signed(self, item: Queued[int]) -> Objective | None:
        """What the proxy signs for the engine (proxy.py objective headers): its priority, the first token due at
        its arrival plus the TTFT target, its TPOT target (the priority it was sent with: flow_control.py). None for the implicit objective (as without one)."""
        if len(self.objectives.by_name) <= 1 and not item.sent_priority:
            return None
        named = self.objectives.named(item.objective)
        # Sent below its band (its tenant past its share), it gives up its deadline, as the proxy signs it.
        deadline = None if named is None or named.ttft_ms is None or item.demoted \
            else item.arrival_s + named.ttft_ms / 1000.0
        return Objective(item.objective, item.sent_priority, deadline, None if named is None else named.tpot_ms)

    def _reserve(self, name: str, request_id: str, prompt_tokens: int, now: float, priority: int = 0,
                 tenant: str = "") -> None:
        """Counted at dispatch (the proxy's _reserve): in flight there (in its band), and on its prefill clock."""
        known = self.replicas[name]
        known.outstanding += 1
        known.held[request_id] = priority
        known.clock.dispatched(request_id, prompt_tokens, known.prefill_tokens_per_ms() * 1000.0, now,
                               priority, tenant)
        self._sent.setdefault(name, set()).add(request_id)

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
            if kind == _FIRST_TOKEN:
                known.clock.prefilled(request_id, t)
                self.outcomes.first_token(self._keys.get(request_id), t)
            else:
                self.outcomes.ended(self._keys.pop(request_id, None), t)
                sent.discard(request_id)
                known.clock.forget(request_id, t)  # ended before its first token: its share of the clock goes
                known.outstanding -= 1
                known.held.pop(request_id, None)
