"""Builders of window stats and profiles for the control-loop tests (figures chosen per test)."""
from __future__ import annotations

from stallfree.contracts import Ceilings, Percentiles, Profile, ProfilePoint, Tuning, WindowStats
from stallfree.operator.control.observe import ReplicaObservation


def pct(p99: float | None, count: int = 100) -> Percentiles:
    if p99 is None:
        return Percentiles(count=count)
    return Percentiles(count=count, p50=p99 * 0.6, p90=p99 * 0.85, p99=p99, max=p99 * 1.1)


def stats(tpot: float = 20.0, ttft: float = 200.0, queue: float = 50.0, budget: int = 512, seqs: int = 64,
          utilisation: float = 0.5, count: int = 100, prompt_rate: float = 5000.0, prefill_rate: float = 5000.0,
          decode_rate: float = 500.0, kv: float = 0.3, preemptions: int = 0, waiting: int = 0, running: int = 10,
          ceilings: Ceilings = Ceilings(2048, 256), window_s: float = 10.0, iterations: int = 400,
          mean_iteration_ms: float = 20.0, request_rate: float = 5.0, generation_rate: float = 500.0,
          tuning: Tuning | None = None) -> WindowStats:
    return WindowStats(
        window_s=window_s, ttft_ms=pct(ttft, count), tpot_ms=pct(tpot, count), itl_ms=pct(tpot * 1.5, count * 10),
        queue_wait_ms=pct(queue, count), request_rate=request_rate, prompt_tokens_per_s=prompt_rate,
        generation_tokens_per_s=generation_rate, prefill_tokens_per_s=prefill_rate, decode_tokens_per_s=decode_rate,
        budget_utilisation=utilisation, kv_usage=kv, preemptions=preemptions, num_waiting=waiting,
        num_running=running, tuning=tuning or Tuning(token_budget=budget, max_num_seqs=seqs), ceilings=ceilings,
        iterations=iterations, mean_iteration_ms=mean_iteration_ms)


def linear_profile(overhead_ms: float = 5.0, ms_per_token: float = 0.05, max_tokens: int = 2048) -> Profile:
    """Iteration time = overhead + ms_per_token x tokens, every 64 tokens."""
    mixed = [ProfilePoint(t, min(32, t // 2), overhead_ms + ms_per_token * t) for t in range(64, max_tokens + 1, 64)]
    return Profile(device="test", decode_only=[], mixed=mixed)


def observation(name: str = "r0", window: WindowStats | None = None, profile: Profile | None = None,
                unknown: str | None = None, ready: bool = True) -> ReplicaObservation:
    return ReplicaObservation(name, ready, window, profile, unknown)
