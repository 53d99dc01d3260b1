"""What the router keeps per objective, and the per-objective part of `/router/queue`. Clock-free: times are passed.

- offered: requests and prompt tokens that named each objective, shed ones included (the control loop sizes for
  the non-sheddable ones and a share of the sheddable: operator/control/objective_demand.py);
- shed: refused at arrival, predicted to miss their TTFT target at every replica (shedding.py), with the reserve
  each band's recent arrivals give (`BandArrivals`);
- outcomes: p99 TTFT and queue wait, judged and good counts (objective_outcomes.py).
"""
from __future__ import annotations

from typing import Sequence

from stallfree.operator.router.objective_outcomes import ObjectiveOutcomes
from stallfree.operator.router.objectives import Objective, Objectives
from stallfree.operator.router.pick import ReplicaView
from stallfree.operator.router.shedding import BandArrivals, sheds


class ObjectiveBook:
    def __init__(self) -> None:
        self.offered_requests: dict[str, int] = {}
        self.offered_tokens: dict[str, int] = {}
        self.shed: dict[str, int] = {}
        self.bands = BandArrivals()
        self.outcomes = ObjectiveOutcomes()

    def offer(self, objective: Objective, prompt_tokens: int, now: float) -> None:
        """A request naming `objective` arrived (before it is shed or queued)."""
        name = objective.name
        self.offered_requests[name] = self.offered_requests.get(name, 0) + 1
        self.offered_tokens[name] = self.offered_tokens.get(name, 0) + prompt_tokens
        self.bands.offered(now, objective.priority, prompt_tokens)

    def predicted_miss_ms(self, objective: Objective, views: list[ReplicaView], starting_in_ms: Sequence[float],
                          prompt_tokens: int, tokens_ahead: int, now: float) -> float | None:
        """The predicted TTFT (ms) when this request is to be shed at arrival (counted so), else None."""
        reserve = self.bands.reserve(objective.priority, now, (objective.ttft_ms or 0.0) / 1000.0)
        predicted = sheds(objective, views, starting_in_ms, prompt_tokens, tokens_ahead, reserve)
        if predicted is not None:
            self.shed[objective.name] = self.shed.get(objective.name, 0) + 1
        return predicted

    def status(self, objectives: Objectives, depths: dict[str, int], now: float) -> dict[str, dict]:
        """Each objective's figures for `/router/queue` (observe_router.py reads them)."""
        return {o.name: {"priority": o.priority, "ttft_ms": o.ttft_ms, "depth": depths.get(o.name, 0),
                         "shed": self.shed.get(o.name, 0), "offered": self.offered_requests.get(o.name, 0),
                         "offered_prompt_tokens": self.offered_tokens.get(o.name, 0),
                         **self.outcomes.figures(o.name, now)}
                for o in objectives.by_name.values()}
