"""Closed-loop runs in virtual time: the real control loop driving VirtualReplicas.

A `VirtualCluster` stands where a Deployment would: replicas are VirtualReplicas (the real scheduler and
KV manager on the cost model), a new one becomes ready `startup_s` after it was asked for, a removed one
stops receiving requests and drains before it goes. Load arrives as Poisson phases into the router's queue
(virtual_router.py: the real router's flow control), which dispatches each request once a ready replica can
start it soon (`router="immediate"`: at once to the replica with the fewest outstanding requests, the
balancer before flow control). A replica's true speed may differ from the profile it reports (speed.py),
and replicas may alternate between GPU models (a mixed fleet). Every control interval the real `ControlLoop` (tuner,
scaler) observes through `VirtualObserver` and acts through `VirtualActuator`, the same Observer and
Actuator seams that Kubernetes and the local runtime plug into.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from stallfree.arrivals import arrival_times
from stallfree.contracts import Ceilings, Profile, Tuning
from stallfree.simulator.speed import SlowedCostModel, SpeedSchedule
from stallfree.simulator.virtual_replica import VirtualReplica
from stallfree.simulator.virtual_router import VirtualRouter
from stallfree.operator.router.flow_control import FlowConfig, dispatch_wait_ms
from stallfree.simulator.workload import LengthDist
from stallfree.operator.control.loop import ControlLoop, StepResult
from stallfree.operator.control.policy import ControlPolicy
from stallfree.operator.control.observe import (NOT_READY, QueueObservation, ReplicaObservation, ReplicaTarget,
                                               classify)


@dataclass(frozen=True)
class LoadPhase:
    """From `start_s` on: Poisson arrivals at `rate` requests/s with these prompt and output lengths."""

    start_s: float
    rate: float
    prompt_len: LengthDist
    output_len: LengthDist
    label: str = ""


@dataclass(frozen=True)
class ClusterSpec:
    model: str
    hardware: str
    dtype: str = "bfloat16"
    ceilings: Ceilings = field(default_factory=Ceilings)
    start_tuning: Tuning = field(default_factory=Tuning)  # the daemons' start-up flags
    max_model_len: int = 8192
    startup_s: float = 20.0  # asked for -> ready
    speed: SpeedSchedule = SpeedSchedule()  # true speed over the profile's, every replica
    hardware_mix: tuple[str, ...] = ()  # replica i runs on hardware_mix[i % len] (a mixed fleet); () = hardware
    router: str = "queue"  # queue: the router's flow control; immediate: least-outstanding at arrival
    queue_wait_slo_ms: float | None = None  # what the router's dispatch share is taken of
    keep_records: bool = False  # keep every finished request's timeline (a scenario judged on goodput)

    def hardware_of(self, index: int) -> str:
        return self.hardware_mix[index % len(self.hardware_mix)] if self.hardware_mix else self.hardware


@dataclass
class _Slot:
    replica: VirtualReplica
    ready_at: float
    index: int = 0
    draining: bool = False
    asked_at: float = 0.0
    start_seen: bool = True  # its start-up (if any) told to the router, which learns start-up times from them


class VirtualCluster:
    def __init__(self, spec: ClusterSpec, window_s: float, replicas: int, now: float = 0.0) -> None:
        self.spec = spec
        self.window_s = window_s
        self.slots: dict[str, _Slot] = {}
        self.removal_rank: dict[str, int] = {}  # name -> rank from the end (0: removed first)
        self.finished: list = []  # finished requests' records of replicas already gone (keep_records)
        self.desired = 0
        self._next_index = 0
        self._profiles: dict[str, Profile] = {}
        if spec.router not in ("queue", "immediate"):
            raise ValueError(f"unknown router {spec.router!r}: queue or immediate")
        self.router = VirtualRouter(FlowConfig(dispatch_wait_ms(spec.queue_wait_slo_ms)), self.profile, window_s,
                                    now=now)
        self._router_t = now
        self.scale_to(replicas, now, ready_now=True)

    # -- the Deployment's verbs --------------------------------------------------------------------------
    def scale_to(self, replicas: int, now: float, ready_now: bool = False) -> None:
        """New replicas start (ready after startup_s); surplus ones, newest first, drain and then go."""
        serving = [name for name, slot in self.slots.items() if not slot.draining]
        # Surplus replicas go from the end: the actuator's preferred ones (prefer_removal) are put there.
        serving.sort(key=lambda name: self.removal_rank.get(name, -1))
        for _ in range(replicas - len(serving)):
            name, index = f"r{self._next_index}", self._next_index
            self._next_index += 1
            self.slots[name] = _Slot(self._new_replica(name, index, now), now if ready_now else now + self.spec.startup_s,
                                     index, asked_at=now, start_seen=ready_now)
        for name in serving[replicas:] if replicas < len(serving) else ():
            self.slots[name].draining = True
        self.desired = replicas

    def restart(self, name: str, now: float) -> None:
        """The replica's process dies and comes back with its start-up flags (queued work is lost)."""
        slot = self.slots[name]
        slot.replica = self._new_replica(name, slot.index, now)
        slot.ready_at = now
        self._profiles.pop(name, None)
        self.router.forget([name])

    def _new_replica(self, name: str, index: int, now: float) -> VirtualReplica:
        spec = self.spec
        # Behind the router's queue, a replica tells the router its first tokens and ends (the proxy's first bytes).
        replies = self.router.observer(name) if spec.router == "queue" else None
        replica = VirtualReplica.for_model(spec.model, spec.hardware_of(index), tuning=spec.start_tuning,
                                           ceilings=spec.ceilings, max_model_len=spec.max_model_len, dtype=spec.dtype,
                                           name=name, stats_window_s=self.window_s, start_time=now, observer=replies,
                                           keep_records=spec.keep_records)
        if not spec.speed.nominal:  # its clock runs at the true speed; its profile stays the nominal curve
            replica.executor.cost_model = SlowedCostModel(replica.cost_model, spec.speed, replica.clock)
        return replica

    def reap(self) -> list[str]:
        """Remove drained replicas (nothing waiting, running or yet to arrive)."""
        gone = [name for name, slot in self.slots.items() if slot.draining and _idle(slot.replica)]
        for name in gone:
            self.finished += self.slots[name].replica.finished
            del self.slots[name]
        self.router.forget(gone)
        return gone

    # -- traffic --------------------------------------------------------------------------------------------
    def routable(self, now: float) -> list[str]:
        return [name for name, slot in self.slots.items() if not slot.draining and slot.ready_at <= now]

    def submit(self, arrivals: Sequence[tuple[Any, ...]], now: float) -> int:
        """Each (arrival time, prompt_len, max_tokens[, objective, tenant]) into the router's queue at its time
        (shed there when its objective is sheddable and predicted to miss), dispatched as the
        router would (`router="immediate"`: at once to the ready replica with the fewest outstanding requests,
        a least-request balancer)."""
        if self.spec.router == "immediate":
            names = self.routable(now)
            if not names:
                return 0
            replicas = [self.slots[name].replica for name in names]
            for arrival, prompt_len, max_tokens in arrivals:
                for replica in replicas:
                    replica.advance_to(arrival)
                target = min(replicas, key=_outstanding)
                target.submit(prompt_len, max_tokens, arrival)
            return len(arrivals)
        accepted = 0
        for arrival, prompt_len, max_tokens, *labels in arrivals:  # labels: (objective, tenant) where named
            self.advance_to(arrival)
            ready = {name: self.slots[name].replica for name in self.routable(arrival)}
            starting = []  # how long each replica not yet ready has been starting
            for slot in self.slots.values():
                if slot.draining:
                    continue
                if slot.ready_at > arrival:
                    starting.append(arrival - slot.asked_at)
                elif not slot.start_seen:
                    slot.start_seen = True
                    self.router.replica_started(slot.ready_at - slot.asked_at)
            accepted += self.router.arrive(arrival, prompt_len, max_tokens, *labels, ready=ready, starting=starting)
            self._dispatch(arrival)
        return accepted

    def advance_to(self, t: float) -> None:
        """Virtual time to `t`; while requests wait in the router's queue, it re-checks every tick."""
        router = self.router
        while len(router.queue) and self._router_t + router.tick_s < t:
            self._router_t += router.tick_s
            self._advance_replicas(self._router_t)
            self._dispatch(self._router_t)
        self._advance_replicas(t)
        self._router_t = max(self._router_t, t)

    def _advance_replicas(self, t: float) -> None:
        for slot in self.slots.values():
            slot.replica.advance_to(t)

    def _dispatch(self, now: float) -> None:
        names = self.routable(now)
        if names:
            self.router.dispatch(now, {name: self.slots[name].replica for name in names})

    def queue_snapshot(self, now: float) -> QueueObservation:
        return self.router.snapshot(now)

    # -- what the control loop sees -----------------------------------------------------------------------
    def targets(self, now: float) -> list[ReplicaTarget]:
        """Replicas that are not terminating (like pods without a deletionTimestamp)."""
        return [ReplicaTarget(name, ready=slot.ready_at <= now, instance=name)
                for name, slot in self.slots.items() if not slot.draining]

    def profile(self, name: str) -> Profile:
        if name not in self._profiles:
            self._profiles[name] = self.slots[name].replica.profile()
        return self._profiles[name]


def _outstanding(replica: VirtualReplica) -> int:
    return replica.num_waiting + replica.num_running + replica.num_pending


def _idle(replica: VirtualReplica) -> bool:
    return _outstanding(replica) == 0


class VirtualObserver:
    """/admin/stats and /admin/profile of each virtual replica; `unreadable` ones fail like a dead admin API."""

    def __init__(self, cluster: VirtualCluster, min_samples: int, unreadable: Sequence[str] = ()) -> None:
        self.cluster = cluster
        self.min_samples = min_samples
        self.unreadable = set(unreadable)

    async def observe(self, targets: Sequence[ReplicaTarget], now: float) -> list[ReplicaObservation]:
        observations = []
        for target in targets:
            if not target.ready:
                observations.append(classify(target, None, None, self.min_samples, NOT_READY))
            elif target.name in self.unreadable:
                observations.append(classify(target, None, None, self.min_samples,
                                             "stats scrape failed: ConnectError: connection refused"))
            else:
                replica = self.cluster.slots[target.name].replica
                stats = replica.window_stats(now)
                observations.append(classify(target, stats, self.cluster.profile(target.name), self.min_samples))
        return observations

    async def observe_queue(self, now: float) -> QueueObservation | None:
        """The router's queue (none with immediate dispatch: nothing waits there)."""
        if self.cluster.spec.router != "queue":
            return None
        return self.cluster.queue_snapshot(now)


class VirtualActuator:
    """PUTs tuning into virtual replicas, scales the virtual cluster, keeps events."""

    def __init__(self, cluster: VirtualCluster) -> None:
        self.cluster = cluster
        self.now = 0.0
        self.events: list[dict[str, Any]] = []
        self.puts: list[tuple[float, str, Tuning]] = []

    async def put_tuning(self, replica: str, tuning: Tuning) -> None:
        self.cluster.slots[replica].replica.set_tuning(tuning)  # raises TuningError like a 422
        self.puts.append((self.now, replica, tuning))

    async def prefer_removal(self, names: Sequence[str]) -> None:
        """On a scale-in, which replicas go first (the scaler's removal_order), as a pod-deletion cost would."""
        self.cluster.removal_rank = {name: len(names) - i for i, name in enumerate(names)}

    async def set_replicas(self, replicas: int) -> None:
        self.cluster.scale_to(replicas, self.now)

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append({"t": self.now, "reason": reason, "message": message, "warning": warning})


@dataclass
class ClosedLoopRun:
    """Everything a run produced: one StepResult per control interval, the events, the load served."""

    steps: list[StepResult]
    events: list[dict[str, Any]]
    submitted: int
    policy: ControlPolicy
    records: list = field(default_factory=list)  # finished requests' timelines (ClusterSpec.keep_records)


def poisson_arrivals(phase: LoadPhase, start: float, end: float, rng: random.Random) -> list[tuple[float, int, int]]:
    """The phase's arrivals in [start, end): each gap drawn, then that request's lengths (one rng, in that order)."""
    if phase.rate <= 0:
        return []
    return [(t, phase.prompt_len.sample(rng), phase.output_len.sample(rng))
            for t in arrival_times(phase.rate, rng, start=start, end=end)]


def active_phase(phases: Sequence[LoadPhase], t: float) -> LoadPhase | None:
    current = None
    for phase in sorted(phases, key=lambda p: p.start_s):
        if phase.start_s <= t:
            current = phase
    return current


class ClosedLoopDriver:
    """Steps load, virtual time and the control loop together, one control interval per `step()`.

    Its parts stay reachable so tests can inject faults between steps: restart a replica, make one
    unreadable, wrap the actuator, or resume the loop from its serialised state.
    """

    def __init__(self, cluster_spec: ClusterSpec, policy: ControlPolicy, phases: Sequence[LoadPhase],
                 replicas: int = 1, unreadable: Sequence[str] = (), seed: int = 0) -> None:
        self.policy = policy
        self.phases = list(phases)
        if cluster_spec.queue_wait_slo_ms is None:  # the router dispatches against the service's SLO
            cluster_spec = replace(cluster_spec, queue_wait_slo_ms=policy.slo.queue_wait_p99_ms)
        self.cluster = VirtualCluster(cluster_spec, policy.window_s, replicas)
        self.observer = VirtualObserver(self.cluster, policy.min_samples, unreadable)
        self.actuator = VirtualActuator(self.cluster)
        self.loop = ControlLoop(policy, self.observer, self.actuator, queue_source=self.observer)
        self.rng = random.Random(seed)
        self.t = 0.0
        self.submitted = 0
        self.steps: list[StepResult] = []

    async def step(self) -> StepResult:
        t, end = self.t, self.t + self.policy.interval_s
        self.submitted += self.cluster.submit(self.arrivals(t, end), t)
        self.cluster.advance_to(end)
        self.cluster.reap()
        self.t = end
        self.actuator.now = end
        result = await self.loop.step(self.cluster.targets(end), self.cluster.desired, end)
        self.steps.append(result)
        return result

    def arrivals(self, t: float, end: float) -> list[tuple[Any, ...]]:
        """This interval's arrivals in time order, cut at phase boundaries so a load step lands when it says."""
        out: list[tuple[Any, ...]] = []
        cuts = sorted({t, end, *(p.start_s for p in self.phases if t < p.start_s < end)})
        for lo, hi in zip(cuts, cuts[1:]):
            phase = active_phase(self.phases, lo)
            if phase is not None:
                out += poisson_arrivals(phase, lo, hi, self.rng)
        return out

    async def run(self, duration_s: float) -> ClosedLoopRun:
        while self.t < duration_s - 1e-9:
            await self.step()
        records = self.cluster.finished + [r for slot in self.cluster.slots.values() for r in slot.replica.finished]
        return ClosedLoopRun(self.steps, self.actuator.events, self.submitted, self.policy, records)


async def run_closed_loop(cluster_spec: ClusterSpec, policy: ControlPolicy, phases: Sequence[LoadPhase],
                          duration_s: float, replicas: int = 1, unreadable: Sequence[str] = (),
                          seed: int = 0) -> ClosedLoopRun:
    """Drive the real control loop over the virtual cluster for `duration_s` virtual seconds."""
    driver = ClosedLoopDriver(cluster_spec, policy, phases, replicas, unreadable, seed)
    return await driver.run(duration_s)
