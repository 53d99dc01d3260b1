"""The demo's verdict per objective over its batch phase: the chat beside a sheddable batch flood (pure).

Client-side, per objective, over the requests sent in that phase: p99 TTFT and TPOT against the objective's
targets, goodput (the share of its requests served within its TTFT target; a shed request is not met), sheds.
What the router promises, and what gates `up --demo`'s exit code: a non-sheddable objective (chat) is served
whole and its p99 TTFT stays within its target while the flood runs (its band goes first in the router's queue);
a sheddable one (batch) is served or refused at arrival (429 with Retry-After), never failed after it waited;
nothing is lost. TPOT is shown, not judged here: the control loop's windows judge it on the daemons (the phase
verdict), while a client-side gap here also carries the event loop that the in-process router, the load
generator and the control loop share.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from stallfree.loadgen.outcome import LOST, REFUSED_AFTER_WAITING, met, outcome, shed
from stallfree.loadgen.stream import RequestResult
from stallfree.operator.router.objectives import Objective
from stallfree.simulator.latency_summary import summarize


@dataclass
class ObjectiveVerdict:
    objective: Objective
    requests: int
    served: int
    shed: int
    refused_after_waiting: int
    lost: int
    p99_ttft_ms: float | None
    p99_tpot_ms: float | None
    goodput: float | None
    missed: list[str] = field(default_factory=list)  # the goals it missed, each with its figures

    @property
    def ok(self) -> bool:
        return not self.missed


def judge_objective(objective: Objective, results: Sequence[RequestResult]) -> ObjectiveVerdict:
    kinds = [outcome(r) for r in results]
    served = [r for r in results if r.ok]
    sheds = [r for r in results if shed(r)]
    p99_ttft = summarize(r.ttft_ms for r in served)["p99"]
    p99_tpot = summarize(r.tpot_ms for r in served if r.tpot_ms is not None)["p99"]
    good = sum(met(r, objective.ttft_ms) for r in served)
    verdict = ObjectiveVerdict(objective, len(results), len(served), len(sheds), kinds.count(REFUSED_AFTER_WAITING),
                               kinds.count(LOST), p99_ttft, p99_tpot, good / len(results) if results else None)
    missed = verdict.missed
    if not results:
        missed.append("no request of this objective was sent")
    if verdict.lost:
        missed.append(f"{verdict.lost} lost (neither answered nor refused)")
    if objective.sheddable:
        if verdict.refused_after_waiting:
            missed.append(f"{verdict.refused_after_waiting} refused after waiting (not at arrival)")
        bare = sum(r.retry_after_s is None for r in sheds)
        if bare:
            missed.append(f"{bare} shed without Retry-After")
        return verdict
    if verdict.served < verdict.requests:
        missed.append(f"{verdict.requests - verdict.served} not served (not sheddable: it should wait)")
    if objective.ttft_ms is not None and p99_ttft is not None and p99_ttft > objective.ttft_ms:
        missed.append(f"p99 TTFT {p99_ttft:.0f} ms > {objective.ttft_ms:.0f} ms")
    return verdict


def judge_objectives(by_objective: dict[str, Sequence[RequestResult]],
                     objectives: Sequence[Objective]) -> list[ObjectiveVerdict]:
    return [judge_objective(o, by_objective.get(o.name, ())) for o in objectives]


def objective_lines(verdicts: Sequence[ObjectiveVerdict], phase: str) -> list[str]:
    lines = [f"  per objective in '{phase}' (client-side):"]
    for v in verdicts:
        o = v.objective
        kind = "sheddable" if o.sheddable else "not sheddable"
        lines.append(f"    {o.name:<6} (priority {o.priority}, {kind}) {v.served}/{v.requests} served, {v.shed} shed, "
                     f"{v.refused_after_waiting} refused after waiting, {v.lost} lost; p99 TTFT {_ms(v.p99_ttft_ms)} "
                     f"(target {_ms(o.ttft_ms)}), TPOT {_ms(v.p99_tpot_ms)} (target {_ms(o.tpot_ms)}: the windows "
                     "judge it); goodput "
                     + ("-" if v.goodput is None else f"{v.goodput:.1%}")
                     + ("" if v.ok else "; MISSED: " + "; ".join(v.missed)))
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"
