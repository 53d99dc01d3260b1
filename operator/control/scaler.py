"""The scaler: how many replicas one InferenceService needs. Pure.

Prefill capacity has run out when every known replica's tuner is at its ceiling (a larger budget would
break TPOT, or the knobs are at their bounds) and queue wait or TTFT still breach, or the demand already
exceeds the scale-up utilisation of the known capacity (so a ramp scales before it breaches). Once that has held
for the scale-up stabilization window, desired = ceil(prompt-token demand / (per-replica prefill
capacity at that budget x scale-up utilisation)): sized from demand, not one more at a time. After a
scale-up, the next waits a scale-up window too, so replicas that are still starting are not counted twice.

Backlog-aware: the count is sized for the arriving demand plus draining the queued prefill work
(queued requests x mean prompt) within `drain_target_s` (tied to the queue-wait SLO), counting the
backlog that still builds on the replicas until new ones are ready (they take the start-up time
measured from earlier ones: the median; the scale-up window before any was seen). A queue lives on its
replica: one whose backlog takes longer than the target to drain at its own capacity drains it alone
(a least-request balancer sends it nothing new meanwhile), so it counts as busy, not as capacity for
the arriving demand; smaller backlogs are drained by spare capacity. The scale-in window then brings
the count back down. Demand beyond `panic_ratio` x the known capacity skips the stabilization wait (a
panic window, as AIBrix's KPA has): waiting would only grow the backlog. The panic window's demand is
the last interval's alone, read off the queues: a replica's prefill work plus its queue's growth since
the previous step (less one Poisson standard deviation of the interval's count), so a step up is sized
an interval after it lands instead of a whole stats window later.

Ahead of predictable load: given a trusted forecast that sees a significant rise (forecast.py: the demand
expected before replicas asked for now would be ready, the stabilization window included), the count is sized
for the larger of the measured demand and that forecast, and a forecast at least MIN_FORECAST_RISE above the
measured demand that needs more replicas than serve now (by the same rule the count is sized by: utilisation and
the queue-wait tail) counts as exhaustion without waiting for the tuner's ceiling or a breach. It still has to
hold for the stabilization window. Scale-in never goes below what the forecast needs. Without one (not trusted:
it forecast badly, or the load stepped; or no significant rise) all is reactive.

Per-replica capacity: replicas at their ceiling show what a replica delivers (their measured mean);
before that, feasibility.py's capacity at the budget the TPOT SLO allows (what SLOFeasible reports).

If the demand already fits the current count and the queues shrink, what still breaches is a backlog
draining: no more replicas for it.

Scale-in: each step that knows every replica recommends the smallest count that carries the demand at
`scale_down_utilisation` of capacity (or the current count while any SLO is missed, except by a replica
draining a backlog of its own: it counts as one replica more, not as a reason to keep a burst's count); the service
shrinks only to the largest recommendation of the whole scale-down window, once a full window passed
since the last change, and only on a step that knows every replica. A step with an unknown replica
recommends nothing: it neither allows nor blocks. Unknown replicas are never read as idle or as loaded:
a ready but unreadable replica is taken to carry its own share (kept, never counted as spare), and one
that is starting adds nothing.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

from stallfree.operator.control.policy import ScalingPolicy
from stallfree.operator.control.queueing import replicas_for_queue_wait
from stallfree.startup import KEEP as KEEP_STARTUPS
from stallfree.startup import expected_startup_s

SCALED_UP, SCALED_DOWN, HOLD = "scaled_up", "scaled_down", "hold"
# Under 3% of requests, not 1%, may wait past the SLO: the M/G/c tail overstates this engine's wait (a replica
# prefills several prompts' chunks in one iteration; docs/control-loop.md compares the two). Scale-in reads the
# stats window's demand, not the last interval's: the scale-down window keeps its largest recommendation.
QUEUE_WAIT_QUANTILE = 0.97
SAME_SPEED = 1.25  # replicas whose prefill capacities differ by less are one speed to the scale-in choice
MIN_FORECAST_RISE = 0.05  # of the measured demand: a forecast less above it does not scale on its own
NO_INFORMATION = -1  # a step that could not recommend (an unknown replica): neither for nor against scale-in


@dataclass(frozen=True)
class ReplicaLoad:
    """What the scaler needs from one replica this step (built from its observation and tuner decision)."""

    name: str
    known: bool
    ready: bool
    unknown_reason: str | None = None
    at_ceiling: bool = False
    breaching: bool = False  # p99 queue wait or TTFT above its SLO
    slo_met: bool = True  # every p99 (TTFT, TPOT, queue wait) within its SLO
    prompt_tokens_per_s: float = 0.0  # demand arriving at this replica
    num_waiting: int = 0  # its queue now
    capacity_tokens_per_s: float | None = None  # prefill capacity at its current budget
    queued_prompt_tokens: float = 0.0  # prefill work waiting in its queue (estimate)
    prefill_tokens_per_s: float = 0.0  # prefill work done (the window's)


@dataclass(frozen=True)
class RouterBacklog:
    """The router's queue (flow control): work that waits for any replica, not for one."""

    queued_requests: int = 0
    queued_prompt_tokens: float = 0.0
    arrival_prompt_tokens_per_s: float | None = None  # the service's demand as the router saw it arrive
    breaching: bool = False  # its oldest request has waited longer than the queue-wait SLO
    # Over the last control interval alone (the panic window's demand), less one Poisson standard deviation.
    recent_arrival_prompt_tokens_per_s: float | None = None
    # Requests/s that arrived over the stats window and the squared coefficient of variation of their prompt
    # lengths: with the queue-wait SLO, how many replicas its tail needs (queueing.py), beyond utilisation.
    arrival_requests_per_s: float | None = None
    prompt_cv2: float | None = None


@dataclass(frozen=True)
class ScalerState:
    exhausted_since: float | None = None
    last_waiting: int | None = None  # known replicas' queues at the previous step
    last_scale_at: float | None = None
    last_direction: int = 0
    # (time, recommended replicas) over the scale-down window
    recommendations: tuple[tuple[float, int], ...] = field(default_factory=tuple)
    starting_since: tuple[tuple[str, float], ...] = ()  # replicas first seen not ready, and when
    startup_s: tuple[float, ...] = ()  # measured start-up times of the last replicas that became ready
    last_step_at: float | None = None
    # Each known replica's (queue length, queued prompt tokens) at the previous step: the short window.
    last_queues: tuple[tuple[str, int, float], ...] = ()
    # Replicas missing an SLO only while they drain a backlog of their own (until they meet every SLO again).
    draining_alone: tuple[str, ...] = ()
    # Replicas the last scale-up added only to drain the backlog (beyond the demand's count): they go once
    # the backlog is drained and every SLO is met again, without waiting out the scale-down window.
    drain_surplus: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ScalerState":
        data = dict(data)
        data["recommendations"] = tuple((float(t), int(n)) for t, n in data.get("recommendations", ()))
        data["starting_since"] = tuple((str(n), float(t)) for n, t in data.get("starting_since", ()))
        data["startup_s"] = tuple(float(x) for x in data.get("startup_s", ()))
        data["last_queues"] = tuple((str(n), int(w), float(q)) for n, w, q in data.get("last_queues", ()))
        data["draining_alone"] = tuple(str(n) for n in data.get("draining_alone", ()))

        return cls(**data)

    def expected_startup_s(self, default: float) -> float:
        return expected_startup_s(self.startup_s, default)


@dataclass(frozen=True)
class ScaleDecision:
    current: int
    desired: int
    kind: str
    reason: str  # a short code (metric label)
    message: str
    capacity_exhausted: bool | None  # None: no known replica to tell
    demand_tokens_per_s: float | None = None
    capacity_per_replica_tokens_per_s: float | None = None
    busy_replicas: int = 0  # replicas sized in as busy draining their own backlog
    # Arrivals over the last interval alone (prefill done + queue growth): the panic window's demand.
    short_demand_tokens_per_s: float | None = None
    # On a scale-in: the replicas to remove first, in order (removal_order); the actuator may honour it.
    remove_first: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def decide_replicas(loads: Sequence[ReplicaLoad], current: int, policy: ScalingPolicy, state: ScalerState,
                    now: float, service_capacity: float | None = None,
                    backlog: RouterBacklog | None = None,
                    queue_wait_slo_s: float | None = None,
                    ttft_slo_s: float | None = None,
                    forecast_tokens_per_s: float | None = None) -> tuple[ScaleDecision, ScalerState]:
    """The replica count for this step. `current` is the count the service is set to now.
    `service_capacity`: one replica's prefill tokens/s at the budget the TPOT SLO allows (feasibility.py),
    the per-replica capacity the count is sized from (never above what replicas at their ceiling show).
    `backlog`: the router's queue, when requests wait there (the demand it saw arrive and the work queued).
    `queue_wait_slo_s`, `ttft_slo_s`: the p99 SLOs; with the router's arrivals, the count for a demand is also at
    least what keeps queue wait within both the queue-wait SLO and the TTFT SLO less a long prompt's prefill
    (queueing.py), not only what its utilisation allows. `forecast_tokens_per_s`: the prompt-token demand a trusted
    forecast expects before replicas asked for now are ready, given only when it sees a significant rise (None:
    size reactively)."""
    backlog = backlog or RouterBacklog()
    state = _track_startup(state, loads, now)
    previous = state
    state = replace(state, last_step_at=now,
                    last_queues=tuple((r.name, r.num_waiting, r.queued_prompt_tokens) for r in loads if r.known))
    known = [r for r in loads if r.known]
    unknown = [r for r in loads if not r.known]
    bounded = max(policy.min_replicas, min(policy.max_replicas, current))
    if bounded != current:
        return _decide(current, bounded, SCALED_UP if bounded > current else SCALED_DOWN, "replica_bounds",
                       f"{current} replicas is outside [{policy.min_replicas}, {policy.max_replicas}]",
                       None, state, now)
    if not known:
        why = "; ".join(f"{r.name}: {r.unknown_reason}" for r in unknown) or "no replicas observed"
        # Nothing known: no decision, and what was pending (exhaustion, recommendations) must not age into one.
        held = replace(state, exhausted_since=None, last_waiting=None,
                       recommendations=_keep(state, now, policy, NO_INFORMATION))
        return ScaleDecision(current, current, HOLD, "no_known_replicas", f"no decision from unknown data ({why})",
                             None), held

    demand = sum(r.prompt_tokens_per_s for r in known)
    if backlog.arrival_prompt_tokens_per_s is not None and not unknown:
        # Replicas see what was dispatched, at most their capacity; what arrived is the router's count.
        demand = max(demand, backlog.arrival_prompt_tokens_per_s)
    short = _short_window_arrivals(known, previous, now)
    # Each replica's arriving prompt tokens/s: the stats window's, or the last interval's when that is more
    # (a step up shows in the queue's growth an interval after it lands, a whole window before the mean).
    arriving = {r.name: max(r.prompt_tokens_per_s, short.get(r.name, 0.0)) for r in known}
    sizing_demand = sum(arriving.values())
    # What arrived at the router is the whole service's demand, whoever carries it. With replicas that cannot be
    # read, the ready ones are sized in as carrying their share at the known replicas' capacity (`fleet`); without
    # the router's count their share is unknown, so they are kept as they are beside what the known ones need.
    router_demand = [x for x in (backlog.arrival_prompt_tokens_per_s, backlog.recent_arrival_prompt_tokens_per_s) if x]
    capacity = _capacity(known, service_capacity)
    serving_unknown = [r for r in unknown if r.ready]  # they serve traffic we cannot see
    if router_demand:
        sizing_demand = max([sizing_demand] + router_demand)
        fleet, kept_aside = len(known) + len(serving_unknown), 0
    else:
        fleet, kept_aside = len(known), len(serving_unknown)
    measured_demand = sizing_demand  # what the backlog grows by until new replicas are ready
    ahead = forecast_tokens_per_s or 0.0
    sizing_demand = max(sizing_demand, ahead)

    def for_queue_wait(demand_tokens_per_s: float) -> int:
        """Replicas that keep queue wait within its target at this demand (0 where the router's arrivals cannot
        tell): QUEUE_WAIT_QUANTILE of requests within the queue-wait SLO and the TTFT SLO less a long prefill."""
        if not (capacity and queue_wait_slo_s and backlog.arrival_requests_per_s and backlog.arrival_prompt_tokens_per_s
                and demand_tokens_per_s > 0):
            return 0
        mean_prompt = backlog.arrival_prompt_tokens_per_s / backlog.arrival_requests_per_s
        cv2 = 1.0 if backlog.prompt_cv2 is None else backlog.prompt_cv2
        wait_s = queue_wait_slo_s
        if ttft_slo_s:
            # TTFT is the wait plus the prefill: a long prompt (mean + 2 standard deviations) leaves this to wait.
            long_prompt = mean_prompt * (1.0 + 2.0 * math.sqrt(cv2))
            wait_s = min(wait_s, max(0.1 * ttft_slo_s, ttft_slo_s - long_prompt / capacity))
        return replicas_for_queue_wait(demand_tokens_per_s / mean_prompt, capacity / mean_prompt, wait_s,
                                       cv2, QUEUE_WAIT_QUANTILE)

    def replicas_for(demand_tokens_per_s: float) -> int:
        """The count a demand needs by the rule the count is sized by: utilisation and the queue-wait tail."""
        return max(math.ceil(demand_tokens_per_s / (capacity * policy.scale_up_utilisation)),
                   for_queue_wait(demand_tokens_per_s))

    # The forecast needs more replicas than serve now: ask before the tuner's ceiling or a breach says so. A
    # forecast within MIN_FORECAST_RISE of what is measured adds nothing the reactive path would not see.
    ahead_full = capacity is not None and ahead > (1.0 + MIN_FORECAST_RISE) * measured_demand \
        and replicas_for(ahead) > fleet

    # Exhausted: no replica can add prefill by tuning, and a queue SLO breaches or the demand already
    # runs past the scale-up utilisation of the capacity (scale before the breach, not after it).
    near_full = capacity is not None and sizing_demand > capacity * fleet * policy.scale_up_utilisation
    exhausted = all(r.at_ceiling for r in known) and (any(r.breaching for r in known) or backlog.breaching
                                                      or near_full) or ahead_full
    waiting = sum(r.num_waiting for r in known) + backlog.queued_requests
    draining = state.last_waiting is not None and waiting < state.last_waiting
    if not exhausted:
        state = replace(state, exhausted_since=None, last_waiting=waiting)
    elif state.exhausted_since is None:
        state = replace(state, exhausted_since=now, last_waiting=waiting)
    else:
        state = replace(state, last_waiting=waiting)
    exhausted_since = state.exhausted_since
    figures = _figures(demand, capacity, known, unknown)
    if ahead > measured_demand:
        figures += f", forecast {ahead:.0f} tok/s before new replicas would be ready"

    if exhausted:
        held_for = now - exhausted_since
        cooling = state.last_direction > 0 and state.last_scale_at is not None and \
            now - state.last_scale_at < policy.scale_up_stabilization_s
        recs = _keep(state, now, policy, current)
        panic = capacity is not None and sizing_demand >= policy.panic_ratio * capacity * fleet
        # Or a certain overload: the router's queue breaches and even the last interval's arrivals less their
        # noise (one Poisson standard deviation) exceed what the fleet prefills. Its queue can only grow, so
        # waiting out the stabilization would only build the backlog the new replicas then drain.
        overloaded = capacity is not None and backlog.breaching and \
            (backlog.recent_arrival_prompt_tokens_per_s or 0.0) > capacity * fleet
        panic = panic or overloaded
        if (held_for < policy.scale_up_stabilization_s and not panic) or cooling:
            wait = ("since the last scale-up" if cooling
                    else f"for {held_for:.0f}s of {policy.scale_up_stabilization_s:g}s")
            return ScaleDecision(current, current, HOLD, "capacity_exhausted_waiting",
                                 f"prefill capacity exhausted ({figures}); waiting {wait}", True, demand,
                                 capacity), replace(state, recommendations=recs)
        starting = [r for r in unknown if not r.ready]
        startup = state.expected_startup_s(policy.scale_up_stabilization_s)
        busy, queued_work = 0, 0.0
        if capacity:
            for r in known:
                # Its queue grows at its unmet share of the demand until new replicas are ready.
                queued = r.queued_prompt_tokens + max(0.0, arriving[r.name] - capacity) * startup
                if queued / capacity > policy.drain_target_s:
                    busy += 1
                else:
                    queued_work += queued
            if backlog.queued_requests:
                # The router's queue is drained by every replica, the new ones included; it grows by the demand
                # the current ones cannot carry until the new ones are ready.
                queued_work += backlog.queued_prompt_tokens + max(0.0, measured_demand - capacity * fleet) * startup
        drain = queued_work / policy.drain_target_s
        need = kept_aside + (busy + max(math.ceil((sizing_demand + drain) / (capacity * policy.scale_up_utilisation)),
                                        for_queue_wait(sizing_demand))
                                       if capacity else len(known) + 1)
        if measured_demand > demand:
            figures += f", {measured_demand:.0f} tok/s arriving over the last interval"
        figures += (f", {busy} replica(s) busy draining their queue alone, backlog {queued_work:.0f} tok to drain in "
                    f"{policy.drain_target_s:g}s, start-up {startup:.0f}s")
        if need <= current and starting:
            # The count already covers the demand; the capacity is still starting (e.g. after a restart of
            # this loop that lost its cooldown): adding more now would scale twice.
            return ScaleDecision(current, current, HOLD, "replicas_starting",
                                 f"prefill capacity exhausted ({figures}) but {current} replicas cover it once "
                                 f"{len(starting)} starting become ready", True, demand,
                                 capacity), replace(state, recommendations=recs)
        if need <= current and draining:
            # Demand fits the count and the queues shrink: what breaches is a backlog on its way out.
            return ScaleDecision(current, current, HOLD, "backlog_draining",
                                 f"queue wait or TTFT breach, but the demand fits {current} replicas ({figures}) "
                                 f"and the queues shrink ({waiting} waiting)",
                                 True, demand, capacity), replace(state, recommendations=recs)
        if need <= current and not backlog.queued_requests and waiting <= len(known):
            # Sized for demand and backlog, nothing waits any more: what breaches is the stats window still
            # holding the requests that waited while the new replicas started. One more would only be paid for.
            return ScaleDecision(current, current, HOLD, "backlog_drained",
                                 f"queue wait or TTFT breach, but nothing waits and {current} replicas cover the "
                                 f"demand ({figures}): the window still holds the drained backlog", True, demand,
                                 capacity), replace(state, recommendations=recs)
        # The count covers the sized demand yet requests still wait and a queue SLO breaches: capacity is short
        # of what the figures say (a queue at this utilisation breaches this SLO): one more, and it stays.
        desired = min(policy.max_replicas, max(current + 1, need))
        if desired == current:
            return ScaleDecision(current, current, HOLD, "at_max_replicas",
                                 f"prefill capacity exhausted ({figures}) but maxReplicas is {policy.max_replicas}",
                                 True, demand, capacity), replace(state, recommendations=recs)
        for_demand = kept_aside + busy + max(math.ceil(sizing_demand / (capacity * policy.scale_up_utilisation)),
                                             for_queue_wait(sizing_demand)) \
            if capacity else desired
        decision, new_state = _decide(current, desired, SCALED_UP,
                                      "forecast_ahead" if ahead > measured_demand else "capacity_exhausted",
                                      f"prefill capacity exhausted ({figures}): {current} -> {desired} replicas",
                                      True, state, now, demand, capacity)
        # The count beyond the demand's was sized to drain the backlog: it may go once that is drained. One more
        # because the sized count still breaches is capacity the demand turned out to need: it stays.
        if need > current:  # (else the surplus an earlier scale-up added for its drain stands)
            new_state = replace(new_state, drain_surplus=max(0, desired - for_demand))
        return replace(decision, busy_replicas=busy, short_demand_tokens_per_s=sizing_demand), new_state

    # Not exhausted: does the load fit fewer replicas, for a whole window?
    if unknown or capacity is None:
        # This step knows too little to recommend anything: it neither allows nor blocks scale-in later,
        # and no decision is taken on it.
        why = [f"{r.name} unknown ({r.unknown_reason})" for r in unknown]
        if capacity is None:
            why.append("prefill capacity unknown")
        recs = _keep(state, now, policy, NO_INFORMATION)
        return ScaleDecision(current, current, HOLD, "scale_in_blocked", "no scale-in: " + "; ".join(why), False,
                             demand, capacity), replace(state, recommendations=recs)
    # A replica that misses only because it drains a backlog of its own (more than a scale-up window of its
    # prefill, shrinking) is busy, not short of replicas: the others' demand decides, it counts as one more.
    # It stays so until it meets every SLO again (its window still shows the queue after the queue is gone).
    last = {name: waiting for name, waiting, _ in previous.last_queues}
    alone = [r.name for r in known if not r.slo_met and (r.name in previous.draining_alone or (
        r.name in last and 0 < r.num_waiting < last[r.name]
        and r.queued_prompt_tokens > capacity * policy.scale_up_stabilization_s))]
    state = replace(state, draining_alone=tuple(alone))
    misses = [r.name for r in known if not r.slo_met and r.name not in alone]
    if backlog.breaching:
        misses.append("the router's queue")  # scale-in would strand queued work
    recommendation = current
    if not misses:
        fits = max(math.ceil(sizing_demand / (capacity * policy.scale_down_utilisation)),
                   for_queue_wait(backlog.arrival_prompt_tokens_per_s or 0.0)) if sizing_demand > 0 else 1
        recommendation = min(current, max(policy.min_replicas, fits + len(alone)))
    recs = _keep(state, now, policy, recommendation)
    state = replace(state, recommendations=recs)
    if state.drain_surplus and not misses and not backlog.queued_requests and not alone \
            and all(r.num_waiting <= 1 for r in known):
        # The backlog the surplus was sized to drain is gone: back to the demand's count at once (those
        # replicas were never demand; the scale-down window guards against demand that comes back).
        target = max(policy.min_replicas, current - state.drain_surplus, recommendation)
        if target < current:
            decision, new_state = _decide(current, target, SCALED_DOWN, "backlog_drained",
                                          f"the backlog is drained and every SLO met: the {current - target} "
                                          f"replica(s) added to drain it go ({figures}): {current} -> {target}",
                                          False, state, now, demand, capacity)
            return decision, replace(new_state, drain_surplus=0)
        state = replace(state, drain_surplus=0)
    stabilized, covered = _stabilized(recs, now, policy)
    since_change = state.last_scale_at is None or state.last_direction < 0 or \
        now - state.last_scale_at >= policy.scale_down_stabilization_s * 0.999
    if stabilized < current and covered and since_change:
        return _decide(current, stabilized, SCALED_DOWN, "load_fits_fewer",
                       f"the load fits {stabilized} replicas at {policy.scale_down_utilisation:.0%} of capacity "
                       f"for {policy.scale_down_stabilization_s:g}s ({figures}): {current} -> {stabilized}",
                       False, state, now, demand, capacity)
    if misses:
        reason, message = "scale_in_blocked", f"no scale-in: {', '.join(misses)} miss(es) an SLO"
    elif recommendation < current:
        reason, message = "stabilizing", (f"the load fits {recommendation} replicas ({figures}); waiting out the "
                                          f"{policy.scale_down_stabilization_s:g}s stabilization window")
    else:
        reason, message = "load_fits", f"{current} replicas carry the load ({figures})"
    return ScaleDecision(current, current, HOLD, reason, message, False, demand, capacity), state


def removal_order(loads: Sequence[ReplicaLoad]) -> tuple[str, ...]:
    """Which replicas a scale-in removes first: those not ready yet (they carry nothing), then the known ones
    slowest first (the least prefill capacity: on a mixed fleet an a100 goes before an h100, so the count kept
    holds the most capacity), newest first among equals; ready replicas that cannot be read go last (they
    carry a share no one can see). Capacities within SAME_SPEED of each other are equal: on one GPU model the
    measured figures differ by noise, and the newest goes, as before."""
    def rank(r: ReplicaLoad) -> tuple[int, int, int, str]:
        group = 0 if not r.ready else (1 if r.known else 2)
        speed = round(math.log(r.capacity_tokens_per_s) / math.log(SAME_SPEED)) if r.capacity_tokens_per_s else 0
        digits = "".join(ch for ch in r.name if ch.isdigit())
        return (group, speed, -int(digits) if digits else 0, r.name)
    return tuple(r.name for r in sorted(loads, key=rank))


def _track_startup(state: ScalerState, loads: Sequence[ReplicaLoad], now: float) -> ScalerState:
    """Note replicas first seen starting; when one becomes ready, how long it took (the last KEEP_STARTUPS kept)."""
    since = dict(state.starting_since)
    measured = list(state.startup_s)
    for r in loads:
        if not r.ready:
            since.setdefault(r.name, now)
        elif r.name in since:
            measured.append(now - since.pop(r.name))
    names = {r.name for r in loads}
    since = {n: t for n, t in since.items() if n in names}
    return replace(state, starting_since=tuple(sorted(since.items())), startup_s=tuple(measured[-KEEP_STARTUPS:]))


def _decide(current: int, desired: int, kind: str, reason: str, message: str, exhausted: bool | None,
            state: ScalerState, now: float, demand: float | None = None,
            capacity: float | None = None) -> tuple[ScaleDecision, ScalerState]:
    direction = 1 if desired > current else -1
    # A change restarts exhaustion (it must be seen again). A scale-up restarts the recommendations; a
    # scale-down keeps them (as Kubernetes' HPA: the count follows the window's largest recommendation down
    # step by step, instead of waiting a whole new window after each step).
    recs = state.recommendations if direction < 0 and state.recommendations else ((now, desired),)
    new_state = ScalerState(last_scale_at=now, last_direction=direction, recommendations=recs,
                            starting_since=state.starting_since, startup_s=state.startup_s,
                            last_step_at=state.last_step_at, last_queues=state.last_queues,
                            drain_surplus=state.drain_surplus)
    return ScaleDecision(current, desired, kind, reason, message, exhausted, demand, capacity), new_state


def _short_window_arrivals(known: Sequence[ReplicaLoad], previous: ScalerState, now: float) -> dict[str, float]:
    """Prompt tokens/s that arrived at each replica whose queue grew over the last interval: its prefill work
    plus that growth (AIBrix KPA's panic window, read off the queue). A queue that did not grow says nothing
    the window does not (the window's prefill rate lags a drained queue): no estimate for it."""
    if previous.last_step_at is None or now <= previous.last_step_at:
        return {}
    dt = now - previous.last_step_at
    last = {name: queued for name, _, queued in previous.last_queues}
    out = {}
    for r in known:
        if r.name in last and r.queued_prompt_tokens > last[r.name]:
            rate = r.prefill_tokens_per_s + (r.queued_prompt_tokens - last[r.name]) / dt
            mean_prompt = r.queued_prompt_tokens / max(1, r.num_waiting)
            count = rate * dt / mean_prompt if mean_prompt > 0 else 0.0
            out[r.name] = short_window_rate(rate * dt, count, dt)
    return out


def short_window_rate(tokens: float, requests: float, seconds: float) -> float:
    """Prompt tokens/s of one short window, less one Poisson standard deviation (sqrt of the request count, at the
    mean prompt): one interval holds few arrivals, and a lucky one must not buy a replica a whole window would not."""
    if seconds <= 0 or requests <= 0:
        return 0.0
    mean_prompt = tokens / requests
    return max(0.0, (tokens - math.sqrt(requests) * mean_prompt) / seconds)


def _capacity(known: Sequence[ReplicaLoad], service_capacity: float | None) -> float | None:
    """Per-replica prefill tokens/s the count is sized from. Replicas at their ceiling show what a replica
    delivers at the budget it will keep: their measured mean. Otherwise their budgets may still rise, so
    what they run now undersells them: feasibility's capacity at the budget the TPOT SLO allows (the
    figure SLOFeasible reports). Without either, the observed mean."""
    at_ceiling = [r.capacity_tokens_per_s for r in known if r.capacity_tokens_per_s and r.at_ceiling]
    if at_ceiling:
        return sum(at_ceiling) / len(at_ceiling)
    if service_capacity:
        return service_capacity
    observed = [r.capacity_tokens_per_s for r in known if r.capacity_tokens_per_s]
    return sum(observed) / len(observed) if observed else None


def _keep(state: ScalerState, now: float, policy: ScalingPolicy, recommendation: int) -> tuple[tuple[float, int], ...]:
    """The window's recommendations plus this one; the newest one at or before the window start stays."""
    horizon = now - policy.scale_down_stabilization_s
    recs = list(state.recommendations) + [(now, recommendation)]
    while len(recs) > 1 and recs[1][0] <= horizon:
        recs.pop(0)
    return tuple(recs)


def _stabilized(recs: tuple[tuple[float, int], ...], now: float, policy: ScalingPolicy) -> tuple[int, bool]:
    """The largest recommendation of the window, and whether known steps cover it well enough to act on.

    Covered: the history reaches back a whole window and at least half of its steps knew every replica
    (steps that did not are no information, neither for nor against scale-in).
    """
    known = [n for _, n in recs if n != NO_INFORMATION]
    if not known:
        return 1 << 30, False
    reaches_back = recs[0][0] <= now - policy.scale_down_stabilization_s * 0.999
    return max(known), reaches_back and len(known) >= 0.5 * len(recs)


def _figures(demand: float, capacity: float | None, known: list[ReplicaLoad], unknown: list[ReplicaLoad]) -> str:
    cap = f"{capacity:.0f}" if capacity else "unknown"
    text = f"demand {demand:.0f} prompt tok/s over {len(known)} known replica(s), capacity {cap} tok/s each"
    if unknown:
        text += f", {len(unknown)} unknown"
    return text
