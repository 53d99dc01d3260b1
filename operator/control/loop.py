"""One InferenceService's control loop: observe -> decide (tuner, scaler) -> act, and report.

The loop does no I/O of its own: an `Observer` reads the replicas and an `Actuator` acts on them, so the
same loop drives Kubernetes (reconcile/k8s_actuator.py), the local runtime and the virtual-time simulation. Its
memory is a `ControlState` that serialises into the service's status: a restarted operator resumes
from it (cooldowns, windows, learned TPOT limits) and does not scale twice.

Acting is level-triggered: every step, a readable replica whose tuning differs from what the tuner
wants gets a PUT, so a replica that restarted with its start-up flags is re-tuned at once.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, Sequence

from stallfree.contracts import Tuning, WindowStats
from stallfree.operator.control.capacity import prefill_capacity_tokens_per_s
from stallfree.operator.control.feasibility import LABELS, Feasibility, assess
from stallfree.operator.control.forecast import Forecast, ForecastState, observe as forecast_arrivals
from stallfree.operator.control.learned_speed import LearnedSpeed
from stallfree.operator.control.objective_demand import sized_for_scaler
from stallfree.operator.control.objective_status import ObjectiveStatus, goodput, objective_statuses
from stallfree.operator.control.policy import ControlPolicy
from stallfree.operator.control.observe import (Observer, QueueObservation, QueueSource, ReplicaObservation,
                                               ReplicaTarget)
from stallfree.operator.control.scaler import (ReplicaLoad, RouterBacklog, ScaleDecision, ScalerState,
                                               decide_replicas, removal_order, short_window_rate)
from stallfree.operator.control.tuner import REAPPLY, ReplicaTunerState, TunerConfig, TuningDecision, decide_tuning

log = logging.getLogger("stallfree.control")

SLO_MET, CAPACITY_EXHAUSTED, SLO_FEASIBLE = "SLOMet", "PrefillCapacityExhausted", "SLOFeasible"
SERVING_PATH = "ServingPath"
# SLOFeasible changes only after the new verdict held this many steps (one window's demand is noisy).
FEASIBILITY_FLIP_STEPS = 2


class Actuator(Protocol):
    """How decisions reach the replicas. Methods raise on failure; the loop records it and retries."""

    async def put_tuning(self, replica: str, tuning: Tuning) -> None: ...

    async def set_replicas(self, replicas: int) -> None: ...

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None: ...


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class ControlState:
    """The loop's memory; round-trips through the InferenceService's status.control.state."""

    tuners: dict[str, ReplicaTunerState] = field(default_factory=dict)
    scaler: ScalerState = field(default_factory=ScalerState)
    desired_replicas: int | None = None
    unknown: list[str] = field(default_factory=list)  # replicas unknown at the last step (for events)
    capacity_exhausted: bool = False
    last_step_at: float | None = None
    feasible_reason: str | None = None  # SLOFeasible's reason as reported (events on a change)
    feasible_pending: str | None = None  # a different verdict seen lately ...
    feasible_pending_steps: int = 0  # ... for this many consecutive steps
    demand_smoothed: float | None = None  # prompt tokens/s, smoothed over steps (feasibility's demand)
    speeds: dict[str, LearnedSpeed] = field(default_factory=dict)  # each replica's, learned from its windows
    forecast: ForecastState = field(default_factory=ForecastState)  # the arrival rate's history and judged error

    def to_dict(self) -> dict[str, Any]:
        return {
            "tuners": {name: s.to_dict() for name, s in self.tuners.items()},
            "scaler": self.scaler.to_dict(),
            "desired_replicas": self.desired_replicas,
            "unknown": list(self.unknown),
            "capacity_exhausted": self.capacity_exhausted,
            "last_step_at": self.last_step_at,
            "feasible_reason": self.feasible_reason,
            "feasible_pending": self.feasible_pending,
            "feasible_pending_steps": self.feasible_pending_steps,
            "demand_smoothed": self.demand_smoothed,
            "speeds": {name: s.to_dict() for name, s in self.speeds.items()},
            "forecast": self.forecast.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "ControlState":
        if not data:
            return cls()
        return cls(
            tuners={name: ReplicaTunerState.from_dict(s) for name, s in (data.get("tuners") or {}).items()},
            scaler=ScalerState.from_dict(data.get("scaler") or {}),
            desired_replicas=data.get("desired_replicas"),
            unknown=list(data.get("unknown") or []),
            capacity_exhausted=bool(data.get("capacity_exhausted", False)),
            last_step_at=data.get("last_step_at"),
            feasible_reason=data.get("feasible_reason"),
            feasible_pending=data.get("feasible_pending"),
            feasible_pending_steps=int(data.get("feasible_pending_steps") or 0),
            demand_smoothed=data.get("demand_smoothed"),
            speeds={name: LearnedSpeed.from_dict(s) for name, s in (data.get("speeds") or {}).items()},
            forecast=ForecastState.from_dict(data.get("forecast")),
        )


@dataclass(frozen=True)
class StepResult:
    time: float
    observations: list[ReplicaObservation]
    tuning: list[TuningDecision]
    scale: ScaleDecision
    conditions: list[Condition]
    failures: list[str]
    state: ControlState
    feasibility: Feasibility = Feasibility()
    queue: QueueObservation | None = None  # the router's queue, where one is read
    forecast: Forecast | None = None  # the arrival rate ahead (None: no router count to fit it on)
    objectives: tuple[ObjectiveStatus, ...] = ()  # per objective, where the router reports them

    @property
    def feasible_line(self) -> str:
        """One line for a live view: SLOFeasible's status and message."""
        cond = next((c for c in self.conditions if c.type == SLO_FEASIBLE), None)
        return "" if cond is None else f"SLOFeasible={cond.status} ({cond.reason}): {cond.message}"

    @property
    def unknown(self) -> list[ReplicaObservation]:
        return [o for o in self.observations if not o.known]

    def observed_p99(self) -> dict[str, float | None]:
        """The worst known replica's p99s (a service meets its SLO only where every replica does)."""
        known = [o.stats for o in self.observations if o.known and o.stats is not None]

        def worst(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return max(present) if present else None

        return {
            "ttft_ms": worst([s.ttft_ms.p99 for s in known]),
            "tpot_ms": worst([s.tpot_ms.p99 for s in known]),
            "queue_wait_ms": worst([s.queue_wait_ms.p99 for s in known]),
        }

    def to_status(self) -> dict[str, Any]:
        """What goes into the InferenceService's status.control (camelCase, JSON-safe)."""
        p99 = self.observed_p99()
        by_name = {d.replica: d for d in self.tuning}
        return {
            "lastStepTime": self.time,
            "observed": {"p99TtftMs": p99["ttft_ms"], "p99TpotMs": p99["tpot_ms"],
                         "p99QueueWaitMs": p99["queue_wait_ms"]},
            "replicas": [_replica_status(o, by_name.get(o.name)) for o in self.observations],
            "unknownReplicas": [{"name": o.name, "reason": o.unknown_reason} for o in self.unknown],
            "decisions": [{"replica": d.replica, "kind": d.kind, "reason": d.reason, "message": d.message}
                          for d in self.tuning if d.kind != "hold" or d.reason == "unknown"],
            "scaling": {"current": self.scale.current, "desired": self.scale.desired, "kind": self.scale.kind,
                        "reason": self.scale.reason, "message": self.scale.message},
            "failures": list(self.failures),
            "feasibility": _feasibility_status(self.feasibility),
            "objectives": [o.to_status() for o in self.objectives],
            "goodput": _r(goodput([o.window for o in self.objectives])),
            "forecast": None if self.forecast is None else {
                "promptTokensPerS": _r(self.forecast.rate), "horizonSeconds": self.forecast.horizon_s,
                "error": _r(self.forecast.error), "trusted": self.forecast.trusted,
                "periodSeconds": self.forecast.period_s, "message": self.forecast.describe()},
            "state": self.state.to_dict(),
        }


class ControlLoop:
    def __init__(self, policy: ControlPolicy, observer: Observer, actuator: Actuator,
                 state: ControlState | None = None, tuner_config: TunerConfig = TunerConfig(),
                 queue_source: QueueSource | None = None) -> None:
        self.policy = policy
        self.observer = observer
        self.queue_source = queue_source  # the router's queue (flow control), where requests wait
        self.actuator = actuator
        self.state = state or ControlState()
        self.tuner_config = tuner_config
        self._queue_unreadable = False  # logged once an outage, and again when it ends

    async def step(self, targets: Sequence[ReplicaTarget], current_replicas: int, now: float) -> StepResult:
        """One control interval. `current_replicas`: the count the service is set to (spec.replicas)."""
        policy, state = self.policy, self.state
        observations = await self.observer.observe(targets, now)
        queue = await self._observe_queue(now)
        observations, speeds = _learn_speeds(observations, state.speeds)
        names = {o.name for o in observations}
        tuners = {name: s for name, s in state.tuners.items() if name in names}  # replicas gone: forgotten
        failures: list[str] = []
        feasibility = assess(observations, policy, state.demand_smoothed,
                             queue.arrival_prompt_tokens_per_s if queue is not None else None)

        decisions: list[TuningDecision] = []
        for obs in observations:
            seed = _settled_tuning([s for name, s in tuners.items() if name != obs.name])
            decision, new_state = decide_tuning(obs, tuners.get(obs.name), policy, now, seed, self.tuner_config,
                                                feasibility)
            if new_state is not None:
                tuners[obs.name] = new_state
            decisions.append(decision)
            if obs.tuning is not None and decision.tuning is not None and decision.tuning != obs.tuning \
                    and policy.tuning_enabled:
                try:
                    await self.actuator.put_tuning(obs.name, decision.tuning)
                except Exception as exc:  # noqa: BLE001 - any failure is retried by the next step's drift check
                    failures.append(f"PUT tuning to {obs.name} failed: {exc}")
                else:
                    if not decision.changed and decision.kind != REAPPLY:
                        # A replica that restarted (or missed a PUT) runs other knobs than it should.
                        await self._event("TuningReapplied", f"{obs.name} ran {_fmt(obs.tuning)}; re-applied "
                                          f"{_fmt(decision.tuning)}")
            if decision.changed or decision.kind == REAPPLY:
                await self._event(_event_reason(decision.kind), f"{obs.name}: {decision.message}")

        loads = [_replica_load(o, d, policy, feasibility) for o, d in zip(observations, decisions)]
        capacity = feasibility.capacity_tokens_per_s if feasibility.known else None
        # Sized for the protected objectives, sheddable ones within their share (objective_demand.py).
        loads, sized_queue = sized_for_scaler(queue, loads, {o.name: o.stats.tpot_ms.p99 for o in observations
                                                             if o.stats is not None}, policy.objectives,
                                              policy.slo.tpot_p99_ms, policy.scaling.sheddable_scale_out_share,
                                              policy.scaling.max_replicas, capacity)
        forecast, forecast_state = _forecast(sized_queue, state, policy, now)  # the demand sized for
        scale, scaler_state = decide_replicas(loads, current_replicas, policy.scaling, state.scaler, now,
                                              feasibility.capacity_tokens_per_s if feasibility.known else None,
                                              router_backlog(sized_queue, policy),
                                              queue_wait_slo_s=policy.slo.queue_wait_p99_ms / 1000.0,
                                              ttft_slo_s=policy.slo.ttft_p99_ms / 1000.0,
                                              forecast_tokens_per_s=forecast.usable_rate if forecast else None)
        if scale.desired < scale.current:
            scale = replace(scale, remove_first=removal_order(loads))
        if scale.changed:
            try:
                if policy.scaling.mode == "managed":
                    prefer = getattr(self.actuator, "prefer_removal", None)  # optional: which replicas go first
                    if prefer is not None and scale.remove_first:
                        await prefer(scale.remove_first)
                    await self.actuator.set_replicas(scale.desired)
                await self._event("ScaledUp" if scale.desired > scale.current else "ScaledDown", scale.message)
            except Exception as exc:  # noqa: BLE001 - the scale did not happen: keep the old state, retry
                failures.append(f"scaling to {scale.desired} failed: {exc}")
                scaler_state = state.scaler
                if scale.desired > scale.current:  # the decision stands: retry at the next step, not a window later
                    scaler_state = replace(scaler_state, exhausted_since=now - policy.scaling.scale_up_stabilization_s)
        if scale.capacity_exhausted and not state.capacity_exhausted:
            await self._event("PrefillCapacityExhausted", scale.message, warning=True)
        unknown = [o.name for o in observations if not o.known]
        for obs in observations:
            if not obs.known and obs.name not in state.unknown:
                await self._event("ReplicaUnknown", f"{obs.name}: {obs.unknown_reason}", warning=True)

        verdict = feasibility_condition(feasibility, observations, decisions, scale, policy, tuners)
        reported, pending, pending_steps = state.feasible_reason, None, 0
        if verdict.status != "Unknown" and verdict.reason != reported:
            pending = verdict.reason
            pending_steps = state.feasible_pending_steps + 1 if state.feasible_pending == pending else 1
            if reported is None or pending_steps >= FEASIBILITY_FLIP_STEPS:
                if verdict.status == "False":
                    await self._event("SLOTradeoff" if verdict.reason == "SLOsConflict" else "SLOInfeasible",
                                      verdict.message, warning=True)
                elif reported is not None:
                    await self._event("SLOFeasible", verdict.message)
                reported, pending, pending_steps = verdict.reason, None, 0
        feasible = verdict if verdict.status == "Unknown" or verdict.reason == reported else \
            Condition(SLO_FEASIBLE, "False" if reported != "Feasible" else "True", reported or "Feasible",
                      f"{verdict.message} (for {pending_steps} step(s); the verdict changes after "
                      f"{FEASIBILITY_FLIP_STEPS})")

        self.state = ControlState(tuners=tuners, scaler=scaler_state,
                                  desired_replicas=scale.desired,
                                  unknown=unknown, capacity_exhausted=bool(scale.capacity_exhausted),
                                  last_step_at=now, feasible_reason=reported, feasible_pending=pending,
                                  feasible_pending_steps=pending_steps,
                                  demand_smoothed=feasibility.demand_tokens_per_s if feasibility.known
                                  else state.demand_smoothed, speeds=speeds, forecast=forecast_state)
        conditions = [slo_condition(observations, policy), capacity_condition(scale), feasible,
                      serving_path_condition(observations)]
        return StepResult(now, observations, decisions, scale, conditions, failures, self.state, feasibility, queue,
                          forecast, objectives=tuple(objective_statuses(queue, policy, capacity)))

    async def _observe_queue(self, now: float) -> QueueObservation | None:
        if self.queue_source is None:
            return None
        try:
            queue = await self.queue_source.observe_queue(now)
        except Exception as exc:  # noqa: BLE001 - an unreadable router queue is no information, not a stop
            if not self._queue_unreadable:
                log.warning("the router's queue is unreadable (%r): steps go on without it until it answers", exc)
            self._queue_unreadable = True
            return None
        if self._queue_unreadable:
            log.info("the router's queue is readable again")
        self._queue_unreadable = False
        return queue

    async def _event(self, reason: str, message: str, warning: bool = False) -> None:
        try:
            await self.actuator.record_event(reason, message, warning)
        except Exception as exc:  # noqa: BLE001 - an event that cannot be recorded must not stop the loop
            log.warning("event %s not recorded (%r): %s", reason, exc, message)


def _learn_speeds(observations: Sequence[ReplicaObservation], speeds: dict[str, LearnedSpeed]
                  ) -> tuple[list[ReplicaObservation], dict[str, LearnedSpeed]]:
    """Each observation with its profile scaled by the speed learned from its windows (this one's included);
    replicas gone are forgotten, a restarted one keeps its name's speed (same node, same neighbours)."""
    out, learned = [], {}
    for obs in observations:
        speed = speeds.get(obs.name, LearnedSpeed()).updated(obs.stats, obs.profile)
        learned[obs.name] = speed
        out.append(replace(obs, profile=speed.apply(obs.profile)))
    return out, learned


def _forecast(queue: QueueObservation | None, state: ControlState, policy: ControlPolicy,
              now: float) -> tuple[Forecast | None, ForecastState]:
    """The arrival rate one ready-delay ahead (the scale-up stabilization, the measured start-up, and the interval
    before the next step can act), fitted on the router's per-interval count; none without the router's queue."""
    if queue is None or queue.recent_s <= 0:
        return None, state.forecast
    scaling = policy.scaling
    horizon = scaling.scale_up_stabilization_s + state.scaler.expected_startup_s(scaling.scale_up_stabilization_s) \
        + policy.interval_s
    return forecast_arrivals(state.forecast, now, queue.recent_prompt_tokens / queue.recent_s, horizon,
                             policy.interval_s)


def router_backlog(queue: QueueObservation | None, policy: ControlPolicy) -> RouterBacklog | None:
    """What the scaler reads of the router's queue: the demand it saw arrive and the work waiting there."""
    if queue is None:
        return None
    recent = None
    if queue.recent_s > 0 and queue.recent_requests > 0:
        recent = short_window_rate(queue.recent_prompt_tokens, queue.recent_requests, queue.recent_s)
    return RouterBacklog(queued_requests=queue.depth, queued_prompt_tokens=queue.queued_prompt_tokens,
                         arrival_prompt_tokens_per_s=queue.arrival_prompt_tokens_per_s,
                         breaching=queue.oldest_wait_ms > policy.slo.queue_wait_p99_ms,
                         recent_arrival_prompt_tokens_per_s=recent,
                         arrival_requests_per_s=queue.arrival_requests_per_s or None, prompt_cv2=queue.prompt_cv2)


def slo_condition(observations: Sequence[ReplicaObservation], policy: ControlPolicy) -> Condition:
    known = [o for o in observations if o.known and o.stats is not None]
    unknown = [o for o in observations if not o.known]
    if not known:
        return Condition(SLO_MET, "Unknown", "NoKnownReplicas",
                         "no replica could be measured: " + _names_with_reasons(unknown))
    breaches = []
    for obs in known:
        breaches += [f"{obs.name} p99 {label} {value:.1f} ms > {limit:g} ms"
                     for label, value, limit in _p99s(obs.stats, policy) if value is not None and value > limit]
    if breaches:
        return Condition(SLO_MET, "False", "SLOBreached", "; ".join(breaches))
    if unknown:
        return Condition(SLO_MET, "Unknown", "ReplicasUnknown",
                         f"{len(known)} replica(s) within SLO; unknown: " + _names_with_reasons(unknown))
    return Condition(SLO_MET, "True", "WithinSLO", f"all {len(known)} replica(s) within their p99 SLOs")


def serving_path_condition(observations: Sequence[ReplicaObservation]) -> Condition:
    """ServingPath: False, naming each replica's slow paths, while any replica serves on a slower path than its
    compiled forward over the model's codes (models/serving_paths.py: a Python forward, dequantized weights)."""
    read = [o for o in observations if o.stats is not None]
    slow = [f"{o.name}: {'; '.join(o.stats.slow_paths)}" for o in read if o.stats.slow_paths]
    if slow:
        return Condition(SERVING_PATH, "False", "SlowPath", " | ".join(slow))
    if not read:
        return Condition(SERVING_PATH, "Unknown", "NoReadableReplicas", "no replica's stats could be read")
    return Condition(SERVING_PATH, "True", "FastPath", f"all {len(read)} replica(s) serve on their compiled forward")


def feasibility_condition(feasibility: Feasibility, observations: Sequence[ReplicaObservation],
                          decisions: Sequence[TuningDecision], scale: ScaleDecision, policy: ControlPolicy,
                          tuners: dict[str, ReplicaTunerState] | None = None) -> Condition:
    """SLOFeasible: False when the profile says an SLO cannot be met (which, the numbers), or when holding
    one SLO breaks another with no replica left to add (which SLO the loop holds, by priority, and why)."""
    if not feasibility.known:
        return Condition(SLO_FEASIBLE, "Unknown", "NoProfile", feasibility.message)
    if not feasibility.feasible:
        return Condition(SLO_FEASIBLE, "False", "SLOInfeasible", feasibility.message)
    traded = _traded(observations, decisions, scale, policy, tuners or {})
    if traded:
        return Condition(SLO_FEASIBLE, "False", "SLOsConflict", traded)
    return Condition(SLO_FEASIBLE, "True", "Feasible", feasibility.message)


def _traded(observations: Sequence[ReplicaObservation], decisions: Sequence[TuningDecision], scale: ScaleDecision,
            policy: ControlPolicy, tuners: dict[str, ReplicaTunerState]) -> str | None:
    """The trade the loop makes now, if any: the tuner holds TPOT (at its ceiling, or under a budget that
    breached TPOT) while queue wait or TTFT breach and the scaler cannot add a replica."""
    if scale.desired < policy.scaling.max_replicas:
        return None
    slo, by_name = policy.slo, {d.replica: d for d in decisions}
    for obs in observations:
        d = by_name.get(obs.name)
        tuner = tuners.get(obs.name)
        holding = d is not None and (d.at_ceiling or (tuner is not None and tuner.tpot_limit_budget is not None))
        if not obs.known or obs.stats is None or not holding:
            continue
        s = obs.stats
        broken = [(LABELS[k], v, limit) for k, v, limit in (("queueWait", s.queue_wait_ms.p99, slo.queue_wait_p99_ms),
                                                            ("ttft", s.ttft_ms.p99, slo.ttft_p99_ms))
                  if v is not None and v > limit]
        if broken:
            order = " > ".join(LABELS[p] for p in policy.slo_priority)
            what = ", ".join(f"p99 {label} {v:.0f} ms > {limit:g} ms" for label, v, limit in broken)
            return (f"holding {LABELS[policy.slo_priority[0]]} first (priority {order}): {obs.name} keeps budget "
                    f"{d.tuning.token_budget if d.tuning else '?'} for TPOT while {what}, and maxReplicas "
                    f"{policy.scaling.max_replicas} is reached")
    return None


def _feasibility_status(f: Feasibility) -> dict[str, Any]:
    return {"feasible": f.feasible if f.known else None, "infeasible": list(f.infeasible), "held": f.held,
            "tpotFloorMs": _r(f.tpot_floor_ms), "tpotTargetMs": _r(f.tpot_target_ms), "tpotBudget": f.tpot_budget,
            "capacityTokensPerS": _r(f.capacity_tokens_per_s), "demandTokensPerS": _r(f.demand_tokens_per_s),
            "replicasNeeded": f.replicas_needed, "message": f.message}


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def capacity_condition(scale: ScaleDecision) -> Condition:
    if scale.capacity_exhausted is None:
        return Condition(CAPACITY_EXHAUSTED, "Unknown", "NoKnownReplicas", scale.message)
    if scale.capacity_exhausted:
        return Condition(CAPACITY_EXHAUSTED, "True", "CapacityExhausted", scale.message)
    return Condition(CAPACITY_EXHAUSTED, "False", "CapacityAvailable", scale.message)


def _p99s(stats: WindowStats, policy: ControlPolicy) -> list[tuple[str, float | None, float]]:
    slo = policy.slo
    return [("TTFT", stats.ttft_ms.p99, slo.ttft_p99_ms), ("TPOT", stats.tpot_ms.p99, slo.tpot_p99_ms),
            ("queue wait", stats.queue_wait_ms.p99, slo.queue_wait_p99_ms)]


def _replica_load(obs: ReplicaObservation, decision: TuningDecision, policy: ControlPolicy,
                  feasibility: Feasibility | None = None) -> ReplicaLoad:
    if (not obs.known and not _sparse(obs)) or obs.stats is None:
        return ReplicaLoad(obs.name, known=False, ready=obs.ready, unknown_reason=obs.unknown_reason)
    stats, slo = obs.stats, policy.slo
    breaching = (stats.queue_wait_ms.p99 or 0.0) > slo.queue_wait_p99_ms or (stats.ttft_ms.p99 or 0.0) > slo.ttft_p99_ms
    slo_met = not breaching and (stats.tpot_ms.p99 or 0.0) <= slo.tpot_p99_ms
    # A budget already at the largest the TPOT target allows cannot add prefill, whatever the window's mean
    # utilisation still says (a queue that just began to build fills every iteration now).
    at_tpot_budget = feasibility is not None and feasibility.tpot_budget is not None and stats.num_waiting > 0 \
        and stats.tuning.token_budget >= feasibility.tpot_budget
    # Queue wait or TTFT press while neither the budget (not full) nor the sequence cap binds: arrivals bunch
    # at a utilisation no knob lowers; fewer requests per replica do. Tuning has nothing left for the scaler.
    not_tunable = decision.reason == "not_budget_bound"  # the tuner's reason for that hold
    return ReplicaLoad(obs.name, known=True, ready=obs.ready,
                       at_ceiling=bool(decision.at_ceiling) or at_tpot_budget or not_tunable,
                       breaching=breaching, slo_met=slo_met, prompt_tokens_per_s=stats.prompt_tokens_per_s,
                       num_waiting=stats.num_waiting,
                       capacity_tokens_per_s=prefill_capacity_tokens_per_s(stats, obs.profile),
                       queued_prompt_tokens=stats.num_waiting * _mean_prompt(stats),
                       prefill_tokens_per_s=stats.prefill_tokens_per_s)


def counts_as_known(obs: ReplicaObservation) -> bool:
    """What the scaler reads as a known replica: a known one, or a sparse one (readable, lightly loaded)."""
    return obs.stats is not None and (obs.known or _sparse(obs))


def _sparse(obs: ReplicaObservation) -> bool:
    """Readable, ready, nothing queued, too few requests for percentiles: lightly loaded, not unknown, to the
    scaler (its demand and queue are measured; the few latencies it has still count). Without this a
    nearly idle service could never scale in. The tuner still takes no decision on it."""
    return (obs.ready and obs.stats is not None and obs.stats.num_waiting == 0
            and (obs.unknown_reason or "").startswith("too few samples"))


def _mean_prompt(stats: WindowStats) -> float:
    """Prompt tokens per request: prefill work per finished request, else demand per finished request."""
    if stats.request_rate <= 0:
        return 0.0
    return (stats.prefill_tokens_per_s or stats.prompt_tokens_per_s) / stats.request_rate


def _settled_tuning(states: list[ReplicaTunerState]) -> Tuning | None:
    """The median tuning sibling replicas run: where a new replica of the same service should start."""
    if not states:
        return None
    ordered = sorted((s.tuning for s in states), key=lambda t: t.token_budget)
    return ordered[(len(ordered) - 1) // 2]


def _event_reason(kind: str) -> str:
    return {"budget_lowered": "BudgetLowered", "budget_raised": "BudgetRaised", "initial": "TuningInitialised",
            "reapply": "TuningReapplied", "max_num_seqs_lowered": "MaxNumSeqsLowered",
            "max_num_seqs_raised": "MaxNumSeqsRaised"}.get(kind, "Tuning")


def _replica_status(obs: ReplicaObservation, decision: TuningDecision | None) -> dict[str, Any]:
    row: dict[str, Any] = {"name": obs.name, "known": obs.known, "ready": obs.ready}
    if obs.unknown_reason:
        row["unknownReason"] = obs.unknown_reason
    if obs.stats is not None:
        s = obs.stats
        row.update(p99TtftMs=s.ttft_ms.p99, p99TpotMs=s.tpot_ms.p99, p99QueueWaitMs=s.queue_wait_ms.p99,
                   tokenBudget=s.tuning.token_budget, maxNumSeqs=s.tuning.max_num_seqs, kvUsage=s.kv_usage,
                   promptTokensPerS=s.prompt_tokens_per_s)
        if s.slow_paths:
            row["slowPaths"] = list(s.slow_paths)
    if decision is not None and decision.tuning is not None:
        row.update(desiredTokenBudget=decision.tuning.token_budget, desiredMaxNumSeqs=decision.tuning.max_num_seqs)
    return row


def _fmt(tuning: Tuning) -> str:
    return f"budget {tuning.token_budget}, max_num_seqs {tuning.max_num_seqs}"


def _names_with_reasons(observations: Sequence[ReplicaObservation]) -> str:
    return "; ".join(f"{o.name} ({o.unknown_reason})" for o in observations)
