"""How one request ended, as the client saw it, and whether it met its objective's targets (pure).

A refusal is clean when the server answered with an HTTP error status (and its body's code); at arrival when
that code is one a router gives before a request waits (`stallfree router`: shed_predicted_miss, queue_full).
A request with neither an answer nor a refusal (a broken connection, a stream error, still open at a time
limit) is lost.
"""
from __future__ import annotations

from stallfree.latency import within_targets
from stallfree.loadgen.stream import RequestResult

SHED_CODE = "shed_predicted_miss"  # operator/router/shedding.py: a sheddable request predicted to miss
AT_ARRIVAL_CODES = (SHED_CODE, "queue_full")  # the router's refusals that come before a request waits

SERVED, REFUSED_AT_ARRIVAL, REFUSED_AFTER_WAITING, LOST = "served", "refused_at_arrival", "refused_after_waiting", "lost"


def outcome(result: RequestResult) -> str:
    if result.ok:
        return SERVED
    if result.status is None:
        return LOST
    return REFUSED_AT_ARRIVAL if result.refusal_code in AT_ARRIVAL_CODES else REFUSED_AFTER_WAITING


def shed(result: RequestResult) -> bool:
    return not result.ok and result.refusal_code == SHED_CODE


def met(result: RequestResult, ttft_ms: float | None, tpot_ms: float | None = None) -> bool:
    """Served within every target given (a one-token reply has no TPOT, so it cannot miss one)."""
    return result.ok and within_targets(result.ttft_ms, result.tpot_ms, ttft_target_ms=ttft_ms, tpot_target_ms=tpot_ms)
