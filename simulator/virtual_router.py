"""The router's flow control in virtual time: the same FlowQueue and dispatch rule as `stallfree router`.

Arrivals wait in one queue per service; every `tick_s` of virtual time while anything waits (the real
router re-checks on each stats poll and whenever a request's prefill finishes or a slot frees), the
oldest requests go to the replicas that can start them soon, each to the one with the lowest predicted
TTFT (pick.py's slo-aware rule, without prefix affinity: simulated prompts share no prefix). A request
keeps its router arrival time on the replica, so the replica's queue wait and TTFT count from it.
"""
from __future__ import annotations

from typing import Callable, Sequence

from stallfree.contracts import Profile, WindowStats
from stallfree.operator.control.observe import QueueObservation
from stallfree.operator.control.queueing import prompt_cv2
from stallfree.operator.router.flow_control import FlowConfig, FlowQueue, Queued
from stallfree.operator.router.pick import ReplicaView, pick
from stallfree.operator.router.rates import decode_step_ms, prefill_tokens_per_ms
from stallfree.simulator.virtual_replica import VirtualReplica

# How often the router's view of a replica's speed is refreshed (its /admin/stats poll, coarser in virtual
# time: the window's calibration moves slowly).
STATS_REFRESH_S = 2.0


def queued_prefill_tokens(replica: VirtualReplica) -> int:
    """Prompt tokens a replica has accepted and not yet prefilled (its waiting queue and partial prefills)."""
    scheduler = replica.scheduler
    tokens = sum(r.num_prompt_tokens - r.num_computed_tokens for r in scheduler.waiting)
    tokens += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in scheduler.running)
    return tokens + replica.pending_prompt_tokens


class VirtualRouter:
    def __init__(self, flow: FlowConfig, profile_of: Callable[[str], Profile], window_s: float,
                 tick_s: float = 0.05) -> None:
        self.queue: FlowQueue[int] = FlowQueue(flow)
        self.profile_of = profile_of
        self.window_s = window_s
        self.tick_s = tick_s
        self._requests: dict[int, tuple[int, int]] = {}  # key -> (prompt_len, max_tokens)
        self._next = 0
        self._stats: dict[str, tuple[float, WindowStats]] = {}
        self._arrived: list[tuple[float, int]] = []  # (time, prompt tokens) over the last window
        self._last_snapshot: float | None = None

    def arrive(self, t: float, prompt_len: int, max_tokens: int) -> bool:
        self._next += 1
        self._arrived.append((t, prompt_len))
        if not self.queue.push(Queued(self._next, t, prompt_len)):
            return False  # counted by the queue (rejected), as the router answers 429
        self._requests[self._next] = (prompt_len, max_tokens)
        return True

    def dispatch(self, now: float, replicas: dict[str, VirtualReplica]) -> int:
        """Send what the replicas can start soon; returns how many went."""
        if not len(self.queue) or not replicas:
            return 0
        views = [self._view(name, replica, now) for name, replica in replicas.items()]

        def choose(item: Queued[int], candidates: list[ReplicaView]):
            return pick("slo-aware", candidates, item.prompt_tokens, item.key)

        sent = self.queue.dispatch(views, choose)
        for item, choice in sent:
            prompt_len, max_tokens = self._requests.pop(item.key)
            replicas[choice.name].submit(prompt_len, max_tokens, item.arrival_s)
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
        return QueueObservation(len(self.queue), self.queue.queued_prompt_tokens,
                                0.0 if oldest is None else max(0.0, now - oldest) * 1000.0,
                                sum(lengths) / span, sum(recent), len(recent), 0.0 if last is None else now - last,
                                arrival_requests_per_s=len(lengths) / span,
                                prompt_cv2=prompt_cv2(len(lengths), sum(lengths), sum(n * n for n in lengths)))

    def _view(self, name: str, replica: VirtualReplica, now: float) -> ReplicaView:
        cached = self._stats.get(name)
        if cached is None or now - cached[0] >= STATS_REFRESH_S:
            cached = (now, replica.window_stats(now))
            self._stats[name] = cached
        stats = cached[1]
        profile = self.profile_of(name)
        return ReplicaView(name=name, queued_prefill_tokens=queued_prefill_tokens(replica),
                           prefill_tokens_per_ms=prefill_tokens_per_ms(profile, stats),
                           step_ms=decode_step_ms(profile, stats),
                           outstanding=replica.num_waiting + replica.num_running + replica.num_pending,
                           max_num_seqs=replica.tuning.max_num_seqs)

    def forget(self, names: Sequence[str]) -> None:
        for name in names:
            self._stats.pop(name, None)
