"""A replica's speed at its live tuning, from its profile (pure): prefill rate and decode-step time."""
from __future__ import annotations

from stallfree.contracts import Profile, WindowStats

# Without a profile or stats: a conservative guess that still orders replicas by their queues.
FALLBACK_PREFILL_TOKENS_PER_MS = 1.0
FALLBACK_STEP_MS = 20.0


def prefill_tokens_per_ms(profile: Profile | None, stats: WindowStats | None) -> float:
    """Prefill tokens per millisecond at the live budget, beside the running decodes."""
    if stats is None:
        return FALLBACK_PREFILL_TOKENS_PER_MS
    budget = stats.tuning.token_budget
    room = max(1, budget - stats.num_running)
    if profile is not None and profile.mixed:
        return room / max(1e-3, profile.iteration_ms_at(budget))
    if stats.mean_iteration_ms:
        return room / stats.mean_iteration_ms
    return FALLBACK_PREFILL_TOKENS_PER_MS


def decode_step_ms(profile: Profile | None, stats: WindowStats | None) -> float:
    """The iteration a first token leaves with: decode-only at the running count, or the measured mean."""
    if stats is not None and profile is not None and profile.decode_only:
        return profile.decode_ms_at(max(1, stats.num_running))
    if stats is not None and stats.mean_iteration_ms:
        return stats.mean_iteration_ms
    return FALLBACK_STEP_MS
