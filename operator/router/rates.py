"""A replica's speed at its live tuning, from its profile (pure): prefill rate and decode-step time."""
from __future__ import annotations

from stallfree.contracts import Profile, WindowStats
from stallfree.profile_rules import calibrated_by, decodes_per_iteration, prefill_room, prefill_tokens_per_s

# Without a profile or stats: a conservative guess that still orders replicas by their queues.
FALLBACK_PREFILL_TOKENS_PER_MS = 1.0
FALLBACK_STEP_MS = 20.0


def prefill_tokens_per_ms(profile: Profile | None, stats: WindowStats | None) -> float:
    """Prefill tokens per millisecond at the live budget beside the window's decodes: the control loop's
    capacity figure (profile_rules.prefill_tokens_per_s), on the profile scaled by what the window observed,
    so the router and the scaler agree on what a replica prefills."""
    if stats is None:
        return FALLBACK_PREFILL_TOKENS_PER_MS
    budget, decodes = stats.tuning.token_budget, decodes_per_iteration(stats)
    if profile is not None and profile.mixed:
        rate = prefill_tokens_per_s(calibrated_by(stats, profile), budget, decodes)
        return rate / 1000.0 if rate is not None else FALLBACK_PREFILL_TOKENS_PER_MS
    if stats.mean_iteration_ms:
        return prefill_room(budget, decodes) / stats.mean_iteration_ms
    return FALLBACK_PREFILL_TOKENS_PER_MS


def decode_step_ms(profile: Profile | None, stats: WindowStats | None) -> float:
    """The iteration a first token leaves with: decode-only at the running count, or the measured mean."""
    if stats is not None and profile is not None and profile.decode_only:
        return profile.decode_ms_at(max(1, stats.num_running))
    if stats is not None and stats.mean_iteration_ms:
        return stats.mean_iteration_ms
    return FALLBACK_STEP_MS
