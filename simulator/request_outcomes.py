"""What became of each request the virtual router took in, as its client saw it: served (with its TTFT, TPOT and
wait), shed at arrival, refused (the queue was full) or lost (its replica went away), judged against its objective's
targets by the router's rule (objective_outcomes.good) with the TPOT the client measures too.

Goodput is the share of requests that met every target of their objective; a shed, refused or lost request met
none. The queue wait is the router's (arrival to dispatch), as the router's per-objective metric has it. `summary`
reads the whole run (or a span of it), per objective and tenant; the control loop reads the router itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from stallfree.contracts import percentile
from stallfree.latency import tpot_s, ttft_s
from stallfree.operator.router.objective_outcomes import good
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
        if self.kind != SERVED or self.first_token_s is None:
            return None
        return ttft_s(self.arrival_s, self.first_token_s) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        tpot = tpot_s(self.first_token_s, self.done_s, self.max_tokens) if self.kind == SERVED else None
        return None if tpot is None else tpot * 1000.0  # every output token is generated (ignore_eos)

    @property
    def wait_ms(self) -> float | None:
        return None if self.dispatched_s is None else (self.dispatched_s - self.arrival_s) * 1000.0

    def good(self, objective: Objective) -> bool:
        """Served, and within every target its objective sets."""
        return self.kind == SERVED and good(objective, self.ttft_ms, self.wait_ms, self.tpot_ms)


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
        self.offered.append(outcome)

    def refused(self, t: float, objective: str, tenant: str, prompt_tokens: int, kind: str = REFUSED) -> None:
        """Refused at arrival: the queue was full (REFUSED) or it was shed (SHED)."""
        outcome = Outcome(t, objective, tenant, prompt_tokens, done_s=t, kind=kind)
        self.offered.append(outcome)
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


def _p99(values: Iterable[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    return float(percentile(present, 0.99)) if present else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
