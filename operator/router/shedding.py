"""Shedding before waiting: a sheddable request predicted to miss its TTFT target everywhere is refused at arrival.

A request of a sheddable objective (priority < 0) that would wait and then miss is worse than one refused at
once: it held a place in the queue, and its client learns nothing until too late. At arrival its TTFT is
predicted as pick.py predicts it on each healthy replica (the prefill queued there, its prompt, a step), plus
the prompt tokens waiting in the router ahead of it (its band and above) drained at the replicas' summed
prefill rate. It is shed only when that misses the target at every replica. A replica that is starting (its
model loading) may take it soon, but the router does not know when it will be ready, so while one is
starting nothing is shed. Pure: views in, verdict out.
"""
from __future__ import annotations

from stallfree.operator.router.objectives import Objective
from stallfree.operator.router.pick import ReplicaView, predict_ttft_ms

SHED_CODE = "shed_predicted_miss"


def predicted_ttft_ms(views: list[ReplicaView], prompt_tokens: int, tokens_ahead: int) -> float | None:
    """The soonest predicted TTFT over `views` with `tokens_ahead` waiting in the router first; None: no view."""
    if not views:
        return None
    total_rate = sum(max(v.prefill_tokens_per_ms, 1e-6) for v in views)
    return min(predict_ttft_ms(v, prompt_tokens) for v in views) + tokens_ahead / total_rate


def sheds(objective: Objective, views: list[ReplicaView], starting: int, prompt_tokens: int,
          tokens_ahead: int) -> float | None:
    """The predicted TTFT (ms) when this request is to be refused at arrival, else None (it waits)."""
    if not objective.sheddable or objective.ttft_ms is None or starting > 0:
        return None
    predicted = predicted_ttft_ms(views, prompt_tokens, tokens_ahead)
    if predicted is None or predicted <= objective.ttft_ms:
        return None
    return predicted
