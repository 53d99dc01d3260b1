"""Per-request latencies from the engine's timestamps (seconds on one clock): one definition for the daemon's
Prometheus metrics, its stats window and the simulator.

TTFT counts from arrival (the router's, when it queued the request first) to the first output token; TPOT is the
mean gap after the first token, (last token - first token) / (output tokens - 1), so a one-token answer has none.
"""
from __future__ import annotations


def ttft_s(arrival_s: float, first_token_s: float) -> float:
    """Time to first token."""
    return first_token_s - arrival_s


def queue_wait_s(arrival_s: float, first_scheduled_s: float | None) -> float | None:
    """Arrival to the first iteration that scheduled the request; None before it was scheduled."""
    return None if first_scheduled_s is None else first_scheduled_s - arrival_s


def itl_s(previous_token_s: float, token_s: float) -> float:
    """Inter-token latency: the gap between two consecutive output tokens of one request."""
    return token_s - previous_token_s


def tpot_s(first_token_s: float | None, last_token_s: float | None, num_output_tokens: int) -> float | None:
    """Time per output token after the first; None with fewer than two tokens (nothing to average)."""
    if num_output_tokens < 2 or first_token_s is None or last_token_s is None:
        return None
    return (last_token_s - first_token_s) / (num_output_tokens - 1)


def within_targets(ttft_ms: float | None, tpot_ms: float | None, queue_wait_ms: float | None = None, *,
                   ttft_target_ms: float | None = None, tpot_target_ms: float | None = None,
                   queue_wait_target_ms: float | None = None) -> bool:
    """Whether a served request met every target given (None: not judged); the one rule goodput counts by.

    A TTFT or queue wait that was not measured misses its target. TPOT is undefined for a one-token reply,
    so a missing TPOT cannot miss one."""
    if ttft_target_ms is not None and (ttft_ms is None or ttft_ms > ttft_target_ms):
        return False
    if queue_wait_target_ms is not None and (queue_wait_ms is None or queue_wait_ms > queue_wait_target_ms):
        return False
    return tpot_target_ms is None or tpot_ms is None or tpot_ms <= tpot_target_ms
