"""Feasibility: what the replicas' measured profile can deliver, set against each SLO. Pure.

Before the tuner moves a knob, it asks whether any setting can meet the SLO at all:
- TPOT: an iteration is never faster than its decodes alone. The profile's decode-only iteration at
  the fewest sequences the bounds allow is the TPOT floor. The profile comes calibrated by the speed the
  loop learned (learned_speed.py) and is taken as it is: never divided by a window again.
  Under prefill load it is higher: the decodes share iterations with prefill chunks of at least the
  smallest budget. The window's p99 TPOT says what share of a request's iterations carried a chunk; that
  share at the smallest budget's iteration, the rest at the decode-only floor, is the lowest
  p99 any setting reaches at this load. An SLO under it cannot be met by any budget or max_num_seqs, and
  the tuner then aims at the closest TPOT it can reach instead of sliding the budget to its floor.
- queue wait and TTFT: at the largest budget the TPOT target allows, one replica prefills so many
  prompt tokens per second; demand beyond maxReplicas of that leaves queues growing, and a prompt
  longer than the TTFT SLO's worth of iterations at that budget misses TTFT even alone.

When SLOs conflict, the loop holds them in priority order (TPOT, then queue wait, then TTFT, unless the
spec says otherwise) and says which one it held and why. The scaler sizes from the same capacity.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from stallfree.operator.control.observe import ReplicaObservation
from stallfree.operator.control.policy import ControlPolicy
from stallfree.profile_rules import (MIN_TOKEN_BUDGET, budget_for_tpot, decodes_per_iteration, prefill_room,
                                     prefill_tokens_per_s)

TPOT, QUEUE_WAIT, TTFT = "tpot", "queueWait", "ttft"
LABELS = {TPOT: "TPOT", QUEUE_WAIT: "queue wait", TTFT: "TTFT"}
# The tuner aims this far under the target it holds (its decrease target); the floor must fit under it.
AIM = 0.75


@dataclass(frozen=True)
class Feasibility:
    infeasible: tuple[str, ...] = ()  # SLOs no setting meets within maxReplicas, in priority order
    held: str | None = None  # when SLOs conflict: the one the loop holds
    tpot_floor_ms: float | None = None  # decode-only iteration at the fewest sequences
    tpot_reachable_ms: float | None = None  # the lowest p99 TPOT any setting reaches at this load
    tpot_target_ms: float | None = None  # the TPOT the tuner aims under: the SLO, or the closest reachable
    tpot_budget: int | None = None  # the largest budget the TPOT target allows
    capacity_tokens_per_s: float | None = None  # one replica's prefill at that budget
    demand_tokens_per_s: float = 0.0
    replicas_needed: int | None = None  # to prefill the demand at that capacity
    ttft_floor_ms: float | None = None  # one mean prompt's prefill alone at that budget
    message: str = ""

    @property
    def known(self) -> bool:
        return self.tpot_floor_ms is not None

    @property
    def feasible(self) -> bool:
        return not self.infeasible

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Weight of this step's demand against the smoothed demand of earlier steps (one window is noisy).
DEMAND_WEIGHT = 0.4


def assess(observations: Sequence[ReplicaObservation], policy: ControlPolicy,
           previous_demand: float | None = None, arrived_demand: float | None = None) -> Feasibility:
    """Feasibility of the service's SLOs from its known replicas (replicas share one profile).
    `previous_demand`: the smoothed demand of earlier steps (prompt tokens/s), blended with this one's.
    `arrived_demand`: prompt tokens/s the router saw arrive (its queue holds what replicas did not take yet)."""
    known = [o for o in observations if o.known and o.stats is not None]
    profiled = [o for o in known if o.profile is not None and o.profile.mixed]
    if not profiled:
        return Feasibility(message="no known replica with a profile: feasibility unknown")
    slo, scaling = policy.slo, policy.scaling
    # The slowest known replica (by its learned speed) sets what is reachable.
    obs = max(profiled, key=lambda o: o.profile.decode_ms_at(1) + o.profile.iteration_ms_at(MIN_TOKEN_BUDGET))
    stats, profile = obs.stats, obs.profile
    bounds = policy.bounds.clipped(stats.ceilings)

    floor = profile.decode_ms_at(bounds.min_num_seqs)
    # The lowest p99 TPOT at this load: the worst replica's, each from its own window and learned speed.
    loaded = max(profiled, key=lambda o: _tpot_at_smallest_budget(o, policy))
    under_load = _tpot_at_smallest_budget(loaded, policy)
    reachable = max(floor, under_load)
    tpot_ok = reachable <= slo.tpot_p99_ms
    # The TPOT to aim at: the SLO, or when it is out of reach, the closest the tuner can settle under.
    target = slo.tpot_p99_ms if tpot_ok else max(slo.tpot_p99_ms, reachable / AIM)

    budget = budget_for_tpot(profile, target, bounds.min_token_budget, bounds.max_token_budget)
    decodes = decodes_per_iteration(stats)
    iteration_ms = profile.iteration_ms_at(budget)
    room = prefill_room(budget, decodes)
    capacity = prefill_tokens_per_s(profile, budget, decodes)

    demand = sum(o.stats.prompt_tokens_per_s for o in known)
    serving = sum(1 for o in observations if o.ready)
    if known and serving > len(known):
        demand *= serving / len(known)  # unreadable replicas serve their share too
    if arrived_demand is not None:
        demand = max(demand, arrived_demand)  # replicas see only what was dispatched to them
    if previous_demand is not None:
        demand = DEMAND_WEIGHT * demand + (1 - DEMAND_WEIGHT) * previous_demand
    if not capacity:  # None: the profile cannot say; 0: the decodes fill the budget, no prompt is prefilled
        needed, queue_ok = None, capacity is None or demand <= 0
    else:
        needed = max(1, math.ceil(demand / capacity)) if demand > 0 else 1
        queue_ok = needed <= scaling.max_replicas
    mean_prompt = _mean_prompt(stats)
    ttft_floor = None
    if mean_prompt:  # no prefill room at all: no prompt ever finishes
        ttft_floor = math.ceil(mean_prompt / room) * iteration_ms if room > 0 else math.inf
    ttft_ok = queue_ok and (ttft_floor is None or ttft_floor <= slo.ttft_p99_ms)

    priority = policy.slo_priority
    ok = {TPOT: tpot_ok, QUEUE_WAIT: queue_ok, TTFT: ttft_ok}
    infeasible = tuple(name for name in priority if not ok[name])
    held = next((name for name in priority if ok[name]), None) if infeasible else None
    notes = []
    if not tpot_ok and floor > slo.tpot_p99_ms:
        notes.append(f"TPOT SLO {slo.tpot_p99_ms:g} ms is under the decode-only iteration at "
                     f"{bounds.min_num_seqs} sequence(s), {floor:.1f} ms: no budget meets it; aiming at "
                     f"{target:.0f} ms, budget {budget}")
    elif not tpot_ok:
        seen = loaded.stats
        lo = policy.bounds.clipped(seen.ceilings).min_token_budget
        notes.append(f"TPOT SLO {slo.tpot_p99_ms:g} ms is under what this load allows: {loaded.name} observed p99 "
                     f"{seen.tpot_ms.p99:.0f} ms at budget {seen.tuning.token_budget}, and even the smallest budget "
                     f"{lo} with {bounds.min_num_seqs} sequence(s) would give {under_load:.0f} ms: no setting meets "
                     f"it; aiming at {target:.0f} ms, budget {budget}")
    if not queue_ok:
        notes.append(f"at budget {budget} (TPOT {target:.0f} ms) one replica prefills {capacity:.0f} tok/s; demand "
                     f"{demand:.0f} tok/s needs {needed} replicas, maxReplicas is {scaling.max_replicas}: queue wait "
                     f"and TTFT cannot be met")
    elif not ttft_ok:
        notes.append(f"a mean prompt of {mean_prompt:.0f} tokens takes {ttft_floor:.0f} ms to prefill alone at "
                     f"budget {budget}, over the TTFT SLO {slo.ttft_p99_ms:g} ms")
    if infeasible and held:
        order = " > ".join(LABELS[p] for p in priority)
        notes.append(f"holding {LABELS[held]} first (priority {order})")
    if not notes:
        notes.append(f"every SLO reachable: TPOT {reachable:.1f} ms at this load <= {slo.tpot_p99_ms:g} ms; at budget {budget} "
                     f"one replica prefills {capacity or 0:.0f} tok/s, demand {demand:.0f} tok/s needs "
                     f"{needed} of maxReplicas {scaling.max_replicas}")
    return Feasibility(infeasible, held, floor, reachable, target, budget, capacity, demand, needed, ttft_floor,
                       "; ".join(notes))


def _tpot_at_smallest_budget(obs: ReplicaObservation, policy: ControlPolicy) -> float:
    """The p99 TPOT this replica's window would show at the smallest settings.

    Two kinds of iteration make a request's TPOT: those that carry a prefill chunk (the budget's full
    iteration) and decode-only ones. The observed p99 at the window's budget tells the share `phi` of the
    former (on the profile as given); at the smallest budget and the fewest sequences the same share costs
    `phi` x the smallest full iteration plus the rest x the decode-only floor. 0 when the window has no
    TPOT: then only the floor speaks.
    """
    stats, profile = obs.stats, obs.profile
    tpot = stats.tpot_ms.p99
    if not tpot:
        return 0.0
    bounds = policy.bounds.clipped(stats.ceilings)
    running = max(1, min(stats.tuning.max_num_seqs, stats.num_running))
    decode_only = profile.decode_ms_at(running)
    full = profile.iteration_ms_at(max(stats.tuning.token_budget, bounds.min_token_budget))
    if full > decode_only:
        phi = min(1.0, max(0.0, (tpot - decode_only) / (full - decode_only)))
    else:
        phi = 1.0 if tpot > decode_only else 0.0
    smallest = profile.iteration_ms_at(bounds.min_token_budget)
    return phi * smallest + (1.0 - phi) * profile.decode_ms_at(bounds.min_num_seqs)


def _mean_prompt(stats) -> float | None:
    """Prompt tokens per finished request (prefill work per request; prompt demand when none was prefilled)."""
    if stats.request_rate <= 0:
        return None
    return (stats.prefill_tokens_per_s or stats.prompt_tokens_per_s) / stats.request_rate
