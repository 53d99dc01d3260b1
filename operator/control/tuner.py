"""The tuner: one replica's token budget and max_num_seqs from its observed window. Pure.

The law, per control step (observation and previous state in, a decision with its reason out):
- start: the profile's budget for `start_fraction` of the TPOT SLO (or the spec's initial budget, or
  what sibling replicas already settled on);
- the TPOT aimed at is the SLO, or, when feasibility.py finds the SLO under the decode-only floor, the
  closest TPOT the replica can reach (so an impossible SLO holds a sensible budget, not the floor);
- p99 TPOT above it with the decodes alone too slow (the calibrated decode-only iteration at the
  running concurrency over `decrease_target` of it): the budget cannot help, so max_num_seqs drops to
  the concurrency whose decode step fits (the rest waits in the queue, where the scaler sees it) and
  comes back up when the decode step has room again;
- p99 TPOT above it otherwise: multiplicative decrease of the budget, sized by the profile (calibrated
  by the speed the loop learned) for the part of the iteration the budget controls (the prefill chunk; the
  decodes stay) to land at `decrease_target`, each step between x`decrease_min` and x`decrease_max`;
  the breached budget is remembered and later raises stay under it;
- p99 TPOT under `raise_below` of the SLO while prefill is the bottleneck (queue wait or TTFT pressure,
  the budget fully used): raise by at most x`raise_max` (or straight to the budget feasibility says the TPOT
  target allows, when that is more), to where the calibrated profile predicts
  `raise_target` of the SLO, never past the remembered breach;
- between the two: hold (the dead band is the hysteresis that lets it settle);
- max_num_seqs: down on preemptions or a full KV cache, up when queue wait presses, the sequence cap is
  what binds and the KV cache has headroom;
- always: the budget at least min_budget_for(max_num_seqs) and inside the live bounds under the ceilings;
- after any change, hold until a whole stats window (plus one typical decode) ran under the new tuning.

`at_ceiling` tells the scaler that this replica cannot add prefill throughput by tuning any more.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from stallfree.contracts import Profile, Tuning, WindowStats, min_budget_for
from stallfree.operator.control.capacity import FULL_UTILISATION
from stallfree.operator.control.feasibility import Feasibility
from stallfree.operator.control.policy import ControlPolicy, TuningBounds
from stallfree.operator.control.observe import ReplicaObservation
from stallfree.profile_rules import SLO_MARGIN, budget_for_tpot, give_way

BUDGET_GRANULE = 16  # budgets move in steps of this many tokens (kernel-friendly, readable)

# Decision kinds (also the `kind` label of the operator's decision counter).
INITIAL, REAPPLY, HOLD = "initial", "reapply", "hold"
BUDGET_LOWERED, BUDGET_RAISED = "budget_lowered", "budget_raised"
SEQS_LOWERED, SEQS_RAISED = "max_num_seqs_lowered", "max_num_seqs_raised"


@dataclass(frozen=True)
class TunerConfig:
    start_fraction: float = SLO_MARGIN  # the daemon starts at the same share (profile_rules.budget_for_tpot)
    decrease_target: float = 0.75
    decrease_min: float = 0.5
    decrease_max: float = 0.85
    raise_below: float = 0.65
    raise_target: float = 0.75
    raise_max: float = 2.0
    min_raise: float = 1.05  # smaller raises are not worth a change
    pressure_fraction: float = 0.5  # queue wait or TTFT above this fraction of its SLO: prefill pressure
    limit_margin: float = 0.9  # raises stay this far under a budget that breached
    limit_memory_s: float = 600.0  # a breached budget is forgotten after this long without a breach
    settle_fraction: float = 0.9  # of the settle time (window + one decode) to wait after a change
    kv_high: float = 0.95
    kv_low: float = 0.75
    seqs_decrease: float = 0.8
    seqs_raise: float = 1.25


@dataclass(frozen=True)
class ReplicaTunerState:
    """What the tuner remembers about one replica (serialised into the InferenceService's status)."""

    tuning: Tuning  # what this replica should run
    last_change_at: float | None = None
    last_direction: int = 0  # +1 budget raised, -1 lowered, 0 not yet moved
    reversals: int = 0
    tpot_limit_budget: int | None = None  # lowest budget that breached TPOT recently
    tpot_limit_at: float | None = None
    at_ceiling: bool = False
    decode_limited: bool = False  # max_num_seqs was lowered because the decode step alone broke TPOT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReplicaTunerState":
        data = dict(data)
        data["tuning"] = Tuning.from_dict(data["tuning"])
        return cls(**data)


@dataclass(frozen=True)
class TuningDecision:
    replica: str
    tuning: Tuning | None  # what the replica should run; None when nothing is known about it
    kind: str
    reason: str  # a short code (metric label)
    message: str
    at_ceiling: bool | None  # None: unknown replica

    @property
    def changed(self) -> bool:
        return self.kind not in (HOLD, REAPPLY)


def decide_tuning(
    observation: ReplicaObservation,
    state: ReplicaTunerState | None,
    policy: ControlPolicy,
    now: float,
    seed: Tuning | None = None,
    config: TunerConfig = TunerConfig(),
    feasibility: Feasibility | None = None,
) -> tuple[TuningDecision, ReplicaTunerState | None]:
    """One replica's decision. `seed`: a tuning sibling replicas settled on (used for a new replica);
    `feasibility`: what the profile can deliver (its TPOT target replaces an SLO no setting meets)."""
    tpot_target = policy.slo.tpot_p99_ms
    if feasibility is not None and feasibility.tpot_target_ms is not None:
        tpot_target = feasibility.tpot_target_ms
    name, stats = observation.name, observation.stats
    if stats is None:
        return _hold(name, state, "unknown", f"no decision: {observation.unknown_reason}", None), state
    if not policy.tuning_enabled:
        # The knobs stay as the replica runs them; fixed knobs cannot add prefill throughput.
        return TuningDecision(name, stats.tuning, HOLD, "tuning_off", "tuning is off for this service",
                              True if observation.known else None), state
    bounds = policy.bounds.clipped(stats.ceilings)
    if state is None:
        start, reason, message = _start(stats, observation.profile, policy, bounds, seed, config, tpot_target)
        state = ReplicaTunerState(tuning=start)
        if start != stats.tuning or not observation.known:
            kind = INITIAL if start != stats.tuning else HOLD
            if not observation.known:
                message += f"; feedback waits: {observation.unknown_reason}"
            return TuningDecision(name, start, kind, reason, message, None), state
    if not observation.known:
        return _hold(name, state, "unknown", f"holding {_fmt(state.tuning)}: {observation.unknown_reason}", None), state
    if stats.tuning != state.tuning:
        # Restarted, or a PUT that did not land: the window measured another tuning, so re-apply and wait.
        return TuningDecision(name, state.tuning, REAPPLY, "tuning_drift",
                              f"replica runs {_fmt(stats.tuning)}, re-applying {_fmt(state.tuning)}",
                              state.at_ceiling), state
    if state.last_change_at is not None and now - state.last_change_at < settle_s(stats, policy, config):
        return _hold(name, state, "settling", "the window's TPOT still holds requests that decoded before the "
                     "last change", state.at_ceiling), state
    return _feedback(observation, stats, state, policy, bounds, now, config, tpot_target,
                     feasibility.tpot_budget if feasibility is not None else None)


def settle_s(stats: WindowStats, policy: ControlPolicy, config: TunerConfig = TunerConfig()) -> float:
    """How long after a change the window still reflects the old tuning.

    A window holds requests that finished in it, and a request's TPOT averages its whole decode: only
    once a window plus one typical decode (output tokens per request x median TPOT) passed does the
    p99 describe the new tuning alone. Deciding earlier would answer the same breach twice.
    """
    decode_s = 0.0
    if stats.request_rate > 0 and stats.tpot_ms.p50:
        decode_s = stats.generation_tokens_per_s / stats.request_rate * stats.tpot_ms.p50 / 1000.0
    return config.settle_fraction * (policy.window_s + decode_s)


# --- start ---------------------------------------------------------------------------------------------

def _start(stats: WindowStats, profile: Profile | None, policy: ControlPolicy, bounds: TuningBounds,
           seed: Tuning | None, config: TunerConfig, tpot_target: float) -> tuple[Tuning, str, str]:
    if seed is not None:
        tuning = _fit(seed, bounds)
        return tuning, "start_from_service", f"start at {_fmt(tuning)}, as sibling replicas settled"
    if policy.initial_token_budget is None and profile is not None and profile.mixed:
        target_ms = config.start_fraction * tpot_target
        budget = budget_for_tpot(profile, tpot_target, lo=bounds.min_token_budget, hi=bounds.max_token_budget,
                                 margin=config.start_fraction)
        tuning = _fit(replace(stats.tuning, token_budget=budget), bounds)
        return tuning, "start_from_profile", (
            f"start at budget {tuning.token_budget}: the profile's largest budget within "
            f"{target_ms:.1f} ms per iteration ({config.start_fraction:.0%} of the TPOT target {tpot_target:.0f} ms)")
    tuning = _fit(stats.tuning if policy.initial_token_budget is None
                  else replace(stats.tuning, token_budget=policy.initial_token_budget), bounds)
    return tuning, "start_from_spec", f"start at {_fmt(tuning)}"


# --- feedback ------------------------------------------------------------------------------------------

def _feedback(obs: ReplicaObservation, stats: WindowStats, state: ReplicaTunerState, policy: ControlPolicy,
              bounds: TuningBounds, now: float, config: TunerConfig,
              tpot_target: float, tpot_budget: int | None = None) -> tuple[TuningDecision, ReplicaTunerState]:
    slo = policy.slo
    tuning = state.tuning
    profile = obs.profile if obs.profile is not None and obs.profile.mixed else None
    # The profile comes calibrated (the loop's learned speed): it is never divided by this window again.
    running = min(tuning.max_num_seqs, max(1, stats.num_running))
    decode_ms = profile.decode_ms_at(running) if profile is not None else None
    budget, seqs = tuning.token_budget, tuning.max_num_seqs
    tpot = stats.tpot_ms.p99 or 0.0
    limit = state.tpot_limit_budget
    if limit is not None and state.tpot_limit_at is not None and now - state.tpot_limit_at > config.limit_memory_s:
        limit = None
    # Cuts: only the budget's part of TPOT shrinks. Raises: all of TPOT scales (the cautious direction).
    predict = _tpot_predictor(stats, profile, budget, tpot, decode_ms, running)
    predict_raise = _tpot_predictor(stats, profile, budget, tpot, None, running)
    queue_pressure = (stats.queue_wait_ms.p99 or 0.0) > config.pressure_fraction * slo.queue_wait_p99_ms
    ttft_pressure = (stats.ttft_ms.p99 or 0.0) > config.pressure_fraction * slo.ttft_p99_ms
    pressure = queue_pressure or ttft_pressure
    budget_full = stats.budget_utilisation >= FULL_UTILISATION

    new_budget, new_seqs = budget, seqs
    kind, reason, notes = HOLD, "within_slo", []
    at_ceiling = False

    target_note = "" if tpot_target == slo.tpot_p99_ms else f" (closest reachable to the SLO {slo.tpot_p99_ms:g} ms)"
    decode_limited = state.decode_limited
    seq_kind = None
    if tpot > tpot_target and decode_ms is not None and decode_ms > config.decrease_target * tpot_target \
            and seqs > bounds.min_num_seqs:
        # The decodes alone break TPOT: no budget can restore it; fewer sequences can.
        fit = profile.decode_curve.largest_x_within(config.decrease_target * tpot_target, bounds.min_num_seqs,
                                                    max(bounds.min_num_seqs, running - 1))
        new_seqs = fit if fit is not None else bounds.min_num_seqs
        seq_kind, reason, at_ceiling, decode_limited = "decode_bound", "decode_bound", True, True
        state = replace(state, tpot_limit_at=now)
        notes.append(f"p99 TPOT {tpot:.1f} ms > {tpot_target:.0f} ms{target_note} and the decode step of {running} "
                     f"sequences alone takes {decode_ms:.1f} ms: max_num_seqs {seqs} -> {new_seqs} (the budget "
                     f"cannot restore it)")
    elif tpot > tpot_target:
        target = config.decrease_target * tpot_target
        lo = max(bounds.min_token_budget, int(budget * config.decrease_min))
        hi = max(lo, int(budget * config.decrease_max))
        candidate = _largest_within(predict, target, lo, hi)
        if candidate is None and profile is not None and predict(lo) >= tpot:
            candidate = budget  # even the deepest cut would not bring TPOT down: hold, do not slide
        new_budget = candidate or lo
        limit = budget if limit is None else min(limit, budget)
        state = replace(state, tpot_limit_at=now)
        kind, reason, at_ceiling = BUDGET_LOWERED, "tpot_breach", True
        if new_budget == budget:
            reason = "tpot_floor"
        notes.append(f"p99 TPOT {tpot:.1f} ms > {tpot_target:.0f} ms{target_note}: budget {budget} -> {{budget}}")
    elif pressure and budget_full:
        cap = bounds.max_token_budget
        if limit is not None:
            cap = min(cap, int(limit * config.limit_margin))
        # At most x raise_max a step, or straight to the budget feasibility says the TPOT target allows (the
        # calibrated profile's): a budget far too small reaches it in one step, not in doublings.
        hi = min(cap, max(int(budget * config.raise_max), tpot_budget or 0))
        lo = int(budget * config.min_raise) + 1
        candidate = None
        if tpot < config.raise_below * tpot_target and hi >= lo:
            candidate = _largest_within(predict_raise, config.raise_target * tpot_target, lo, hi)
        if candidate is not None:
            new_budget = candidate
            kind, reason = BUDGET_RAISED, "prefill_pressure"
            what = "queue wait" if queue_pressure else "TTFT"
            notes.append(f"prefill is the bottleneck ({what} p99 "
                         f"{(stats.queue_wait_ms.p99 if queue_pressure else stats.ttft_ms.p99) or 0:.0f} ms, budget "
                         f"{stats.budget_utilisation:.0%} used) with TPOT slack ({tpot:.1f} ms): "
                         f"budget {budget} -> {{budget}}")
        else:
            at_ceiling = True
            why = ("at its bound" if budget >= bounds.max_token_budget
                   else f"p99 TPOT {tpot:.1f} ms leaves no room under {config.raise_below:.0%} of the SLO"
                   if tpot >= config.raise_below * tpot_target
                   else f"a larger budget would break TPOT (limit {limit})" if limit is not None
                   else "the profile predicts a TPOT breach")
            reason = "tpot_limited" if budget < bounds.max_token_budget else "at_bounds"
            notes.append(f"prefill pressure but the budget {budget} is {why}")
    elif pressure:
        reason = "not_budget_bound"

    # max_num_seqs: preemptions and a full KV cache push it down, queue wait with KV headroom pulls it up.
    if seq_kind is not None:
        pass
    elif stats.preemptions > 0 or stats.kv_usage >= config.kv_high:
        running_cap = max(1, int(stats.num_running * 0.9)) if stats.num_running else seqs
        candidate = max(bounds.min_num_seqs, min(int(seqs * config.seqs_decrease), running_cap))
        if candidate < seqs:
            new_seqs, seq_kind = candidate, "preemptions" if stats.preemptions > 0 else "kv_pressure"
            notes.append(f"{stats.preemptions} preemptions, KV {stats.kv_usage:.0%} used: "
                         f"max_num_seqs {seqs} -> {new_seqs}")
    elif ((queue_pressure and not budget_full) or (decode_limited and stats.num_waiting > 0)) \
            and stats.num_running >= 0.9 * seqs and stats.kv_usage <= config.kv_low \
            and tpot < config.raise_below * tpot_target:
        candidate = min(bounds.max_num_seqs, max(seqs + 1, int(seqs * config.seqs_raise)))
        if profile is not None:
            # Only as far as the decode step keeps room under the TPOT target.
            fit = profile.decode_curve.largest_x_within(config.raise_target * tpot_target, seqs, candidate)
            candidate = seqs if fit is None else fit
        while candidate > seqs and min_budget_for(candidate) > max(new_budget, budget):
            candidate -= 1
        if candidate > seqs:
            new_seqs, seq_kind = candidate, "queue_wait"
            notes.append(f"requests wait while {stats.num_running} run at the cap, the decode step has room and KV is "
                         f"{stats.kv_usage:.0%} used: max_num_seqs {seqs} -> {new_seqs}")
        else:
            at_ceiling = True
            notes.append(f"queue wait presses but max_num_seqs {seqs} is at its bound")
    if decode_limited and new_seqs >= bounds.max_num_seqs:
        decode_limited = False

    fitted = _fit(replace(tuning, token_budget=new_budget, max_num_seqs=new_seqs), bounds)
    if kind == HOLD and seq_kind is not None:
        kind = SEQS_LOWERED if fitted.max_num_seqs < seqs else SEQS_RAISED
        reason = seq_kind
    message = "; ".join(notes).replace("{budget}", str(fitted.token_budget)) or _hold_message(reason, tpot, tpot_target)
    if fitted == tuning:
        held = replace(state, at_ceiling=at_ceiling, tpot_limit_budget=limit, decode_limited=decode_limited)
        return _hold(obs.name, held, reason, message, at_ceiling), held
    direction = (fitted.token_budget > budget) - (fitted.token_budget < budget)
    reversals = state.reversals + (direction != 0 and state.last_direction != 0 and direction != state.last_direction)
    new_state = replace(state, tuning=fitted, last_change_at=now, reversals=reversals,
                        last_direction=direction or state.last_direction, tpot_limit_budget=limit,
                        at_ceiling=at_ceiling, decode_limited=decode_limited)
    return TuningDecision(obs.name, fitted, kind, reason, message, at_ceiling), new_state


def _hold_message(reason: str, tpot: float, tpot_target: float) -> str:
    if reason == "not_budget_bound":
        return "queue wait presses but the budget is not fully used: the budget is not the bottleneck"
    return f"p99 TPOT {tpot:.1f} ms within {tpot_target:.0f} ms, no prefill pressure"


def _tpot_predictor(stats: WindowStats, profile: Profile | None, budget: int, observed_tpot: float,
                    decode_ms: float | None, running: int) -> Callable[[int], float]:
    """p99 TPOT at another budget: the decodes' share stays, the rest scales with the prefill chunk.

    With a profile, the observed TPOT above the (calibrated) decode-only step is the budget's part; it
    scales by the profile's iteration time over the decode step's from `budget` to `b`. The learned speed
    carries what the profile does not see (long prefixes' attention, a busy machine). With `decode_ms`
    None (raises), all of TPOT scales by the profile's iteration-time ratio: cautious. Without a profile,
    TPOT is taken as proportional to the budget: pessimistic for raises.
    """
    if profile is not None:
        base = profile.iteration_ms_at(budget)
        if decode_ms is not None:
            fixed = min(decode_ms, observed_tpot)
            decode_part = profile.iteration_ms_at(max(1, running))
            span = base - decode_part
            if span > 0:
                return lambda b: fixed + (observed_tpot - fixed) * max(0.0, profile.iteration_ms_at(b)
                                                                        - decode_part) / span
            return lambda b: observed_tpot  # the budget's part is nil in the profile: cuts cannot help
        if base > 0:
            return lambda b: observed_tpot * profile.iteration_ms_at(b) / base
    return lambda b: observed_tpot * b / max(1, budget)


def _largest_within(predict: Callable[[int], float], target_ms: float, lo: int, hi: int) -> int | None:
    """Largest budget in [lo, hi], on the granule where the range allows, whose predicted TPOT fits."""
    if hi - lo >= BUDGET_GRANULE:
        lo = -(-lo // BUDGET_GRANULE) * BUDGET_GRANULE
        hi = hi // BUDGET_GRANULE * BUDGET_GRANULE
    if hi < lo or predict(lo) > target_ms:
        return None
    step = BUDGET_GRANULE if (hi - lo) % BUDGET_GRANULE == 0 else 1
    # Bisection over the grid lo, lo + step, ..., hi (predicted TPOT grows with the budget).
    good, bad = 0, (hi - lo) // step + 1
    while bad - good > 1:
        mid = (good + bad) // 2
        if predict(lo + mid * step) <= target_ms:
            good = mid
        else:
            bad = mid
    return lo + good * step


def _fit(tuning: Tuning, bounds: TuningBounds) -> Tuning:
    """Inside the bounds, with the budget at least min_budget_for(max_num_seqs) (max_num_seqs gives way)."""
    seqs = max(bounds.min_num_seqs, min(bounds.max_num_seqs, tuning.max_num_seqs))
    budget = max(bounds.min_token_budget, min(bounds.max_token_budget, tuning.token_budget))
    budget, seqs = give_way(budget, seqs, bounds.min_num_seqs, bounds.max_token_budget)
    return replace(tuning, token_budget=budget, max_num_seqs=seqs)


def _hold(name: str, state: ReplicaTunerState | None, reason: str, message: str,
          at_ceiling: bool | None) -> TuningDecision:
    return TuningDecision(name, state.tuning if state else None, HOLD, reason, message, at_ceiling)


def _fmt(tuning: Tuning) -> str:
    return f"budget {tuning.token_budget}, max_num_seqs {tuning.max_num_seqs}"
