"""What became of each request the virtual router took in: served (with its TTFT, TPOT and wait), shed at arrival,
refused (the queue was full) or lost (its replica went away), judged against its objective's targets.

Goodput is the share of requests that met every target of their objective (TTFT, TPOT, queue wait where the
objective sets one); a shed, refused or lost request met none. The queue wait is the router's (arrival to
dispatch), as the router's per-objective metric has it. Two readings: `windows` (per objective over the stats
window, what the router reports to the control loop) and `summary` (the whole run, per objective and tenant).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from stallfree.contracts import percentile
from stallfree.latency import within_targets
from stallfree.operator.control.observe import ObjectiveWindow
from stallfree.operator.router.flow_control import Queued
from stallfree.operator.router.objectives import Objective, Objectives

SERVED, SHED, REFUSED, LOST = "served", "shed", "refused", "lost"


@dataclass
class Outcome:
    arrival_s: float
    objective: str
    tenant: str
    prompt_tokens: int
    max_tokens: int = 1
    dispatched_s: float | None = None
    first_token_s: float | None = None
    done_s: float | None = None  # answered, refused or lost
    kind: str = ""  # "" while in flight

    @property
    def ttft_ms(self) -> float | None:
        if self.kind != SERVED:
            return None
        first = self.first_token_s if self.first_token_s is not None else self.done_s
        return (first - self.arrival_s) * 1000.0 if first is not None else None

    @property
    def tpot_ms(self) -> float | None:
        if self.kind != SERVED or self.first_token_s is None or self.done_s is None or self.max_tokens < 2:
            return None
        return (self.done_s - self.first_token_s) * 1000.0 / (self.max_tokens - 1)

    @property
    def wait_ms(self) -> float | None:
        return None if self.dispatched_s is None else (self.dispatched_s - self.arrival_s) * 1000.0

    def good(self, objective: Objective) -> bool:
        """Served, and within every target its objective sets."""
        return self.kind == SERVED and within_targets(
            self.ttft_ms, self.tpot_ms, self.wait_ms, ttft_target_ms=objective.ttft_ms,
            tpot_target_ms=objective.tpot_ms, queue_wait_target_ms=objective.queue_wait_ms)


class Outcomes:
    def __init__(self, objectives: Objectives) -> None:
        self.objectives = objectives
        self.in_flight: dict[int, Outcome] = {}
        self.done: list[Outcome] = []  # in the order they ended (done_s nondecreasing but for lost ones)
        self.offered: list[Outcome] = []  # every arrival, in arrival order

    # -- what the router saw happen ------------------------------------------------------------------------
    def arrived(self, key: int, t: float, objective: str, tenant: str, prompt_tokens: int, max_tokens: int) -> None:
        outcome = Outcome(t, objective, tenant, prompt_tokens, max_tokens)
        self.in_flight[key] = outcome
        self._offer(outcome)

    def _offer(self, outcome: Outcome) -> None:
        self.offered.append(outcome)

    def shed(self, t: float, objective: str, tenant: str, prompt_tokens: int) -> None:
        self._refused(t, objective, tenant, prompt_tokens, SHED)

    def refused(self, t: float, objective: str, tenant: str, prompt_tokens: int) -> None:
        self._refused(t, objective, tenant, prompt_tokens, REFUSED)

    def _refused(self, t: float, objective: str, tenant: str, prompt_tokens: int, kind: str) -> None:
        outcome = Outcome(t, objective, tenant, prompt_tokens, done_s=t, kind=kind)
        self._offer(outcome)
        self.done.append(outcome)

    def dispatched(self, key: int, t: float) -> None:
        if key in self.in_flight:
            self.in_flight[key].dispatched_s = t

    def first_token(self, key: int | None, t: float) -> None:
        if key in self.in_flight:
            self.in_flight[key].first_token_s = t

    def ended(self, key: int | None, t: float) -> None:
        self._end(key, t, SERVED)

    def lost(self, key: int, t: float | None = None) -> None:
        self._end(key, t, LOST)

    def _end(self, key: int | None, t: float | None, kind: str) -> None:
        outcome = self.in_flight.pop(key, None) if key is not None else None
        if outcome is None:
            return
        outcome.kind = kind
        outcome.done_s = t if t is not None else (outcome.first_token_s or outcome.dispatched_s or outcome.arrival_s)
        self.done.append(outcome)

    # -- readings -----------------------------------------------------------------------------------------
    def windows(self, now: float, window_s: float, last_s: float | None,
                queued: Sequence[Queued[int]]) -> tuple[ObjectiveWindow, ...]:
        """Each objective over the last `window_s` (arrivals since `last_s`: the last interval's)."""
        horizon = now - window_s
        span = min(window_s, max(now, 1e-9))
        out = []
        ended = _recent(self.done, horizon, lambda o: o.done_s or 0.0)
        arrived = _recent(self.offered, horizon, lambda o: o.arrival_s)
        for name, objective in sorted(self.objectives.by_name.items()):
            mine = [o for o in ended if o.objective == name]
            offered = [o for o in arrived if o.objective == name]
            recent = [o for o in offered if last_s is not None and o.arrival_s > last_s]
            waiting = [q for q in queued if q.objective == name]
            served = [o for o in mine if o.kind == SERVED]
            out.append(ObjectiveWindow(
                name, objective.priority, arrival_prompt_tokens_per_s=sum(o.prompt_tokens for o in offered) / span,
                recent_prompt_tokens=float(sum(o.prompt_tokens for o in recent)), recent_requests=len(recent),
                arrival_requests_per_s=len(offered) / span, depth=len(waiting),
                queued_prompt_tokens=float(sum(q.prompt_tokens for q in waiting)),
                oldest_wait_ms=max((now - q.arrival_s) * 1000.0 for q in waiting) if waiting else 0.0,
                shed=sum(1 for o in mine if o.kind == SHED), completed=sum(1 for o in mine if o.kind != SHED),
                good=sum(1 for o in mine if o.good(objective)),
                ttft_p99_ms=_p99(o.ttft_ms for o in served), tpot_p99_ms=_p99(o.tpot_ms for o in served),
                queue_wait_p99_ms=_p99(o.wait_ms for o in served)))
        return tuple(out)

    def summary(self, start_s: float = 0.0, end_s: float = float("inf"), tenant: str | None = None,
                objective: str | None = None) -> dict[str, Any]:
        """Requests that arrived in [start_s, end_s) and are done, by objective: counts, goodput and p99s."""
        picked = [o for o in self.done if start_s <= o.arrival_s < end_s and (tenant is None or o.tenant == tenant)
                  and (objective is None or o.objective == objective)]
        out: dict[str, Any] = {}
        for name, obj in sorted(self.objectives.by_name.items()):
            mine = [o for o in picked if o.objective == name]
            if not mine:
                continue
            served = [o for o in mine if o.kind == SERVED]
            out[name] = {"requests": len(mine), "served": len(served),
                         "shed": sum(1 for o in mine if o.kind == SHED),
                         "refused": sum(1 for o in mine if o.kind == REFUSED),
                         "lost": sum(1 for o in mine if o.kind == LOST),
                         "good": sum(1 for o in mine if o.good(obj)),
                         "goodput": round(sum(1 for o in mine if o.good(obj)) / len(mine), 4),
                         "served_late": sum(1 for o in served if obj.ttft_ms is not None
                                            and (o.ttft_ms or 0.0) > obj.ttft_ms),
                         "p99_ttft_ms": _round(_p99(o.ttft_ms for o in served)),
                         "p99_tpot_ms": _round(_p99(o.tpot_ms for o in served)),
                         "p99_queue_wait_ms": _round(_p99(o.wait_ms for o in served)),
                         "prefill_tokens_served": sum(o.prompt_tokens for o in served)}
        return out

    def tenants(self) -> list[str]:
        return sorted({o.tenant for o in self.offered})


def _recent(items: list[Outcome], horizon: float, when) -> list[Outcome]:
    """The items after `horizon`, read from the end (the lists grow in time order)."""
    out = []
    for item in reversed(items):
        if when(item) <= horizon:
            break
        out.append(item)
    return out


def _p99(values: Iterable[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    return float(percentile(present, 0.99)) if present else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
