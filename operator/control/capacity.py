"""Prefill capacity of one replica: prompt tokens per second it can prefill at its current token budget.

Each iteration first gives every running decode its token; the rest of the budget is prefill room. At
full budget an iteration takes the profile's time for `budget` tokens, calibrated by how the observed
mean iteration compares with the profile's prediction for the tokens it actually ran (long prompts'
attention to their prefix makes real iterations slower than a short-context profile says). Without a
profile, only a window whose budget was fully used tells its own full-budget iteration time.
"""
from __future__ import annotations

from stallfree.contracts import Profile, WindowStats

# Below this budget utilisation a profile calibration would mostly measure fixed overhead: trust the profile.
_CALIBRATE_ABOVE_UTILISATION = 0.5
FULL_UTILISATION = 0.85


def prefill_capacity_tokens_per_s(stats: WindowStats, profile: Profile | None) -> float | None:
    """Prefill tokens/s at the current budget and decode load, or None when the window cannot tell."""
    budget = stats.tuning.token_budget
    if stats.iterations <= 0 or not stats.mean_iteration_ms or budget <= 0:
        return None
    # Mean tokens of a busy iteration, split by the window's decode share (both independent of its span).
    tokens_per_iteration = stats.budget_utilisation * budget
    total_rate = stats.decode_tokens_per_s + stats.prefill_tokens_per_s
    decode_share = stats.decode_tokens_per_s / total_rate if total_rate > 0 else 0.0
    decode_per_iteration = tokens_per_iteration * decode_share
    prefill_room = max(0.0, budget - decode_per_iteration)
    if profile is not None and profile.mixed:
        calibration = 1.0
        if stats.budget_utilisation >= _CALIBRATE_ABOVE_UTILISATION and tokens_per_iteration >= 1:
            predicted = profile.iteration_ms_at(round(tokens_per_iteration))
            if predicted > 0:
                calibration = stats.mean_iteration_ms / predicted
        full_budget_ms = calibration * profile.iteration_ms_at(budget)
    elif stats.budget_utilisation >= FULL_UTILISATION:
        full_budget_ms = stats.mean_iteration_ms
    else:
        return None
    if full_budget_ms <= 0:
        return None
    return prefill_room / (full_budget_ms / 1000.0)


def calibration(stats: WindowStats, profile: Profile | None) -> float:
    """Observed mean iteration over the profile's prediction for the tokens the window's iterations ran.

    1.0 when the window cannot tell (idle, no profile). Mostly-decode windows are compared with the
    decode-only curve, the rest with the mixed curve; the ratio carries what the profile does not see
    (long contexts, a busy machine) into every prediction made from it.
    """
    seen = observed_calibration(stats, profile)
    return 1.0 if seen is None else seen[1]


def observed_calibration(stats: WindowStats, profile: Profile | None) -> tuple[str, float] | None:
    """("decode" | "mixed", observed over predicted) when the window can tell, else None."""
    budget = stats.tuning.token_budget
    if profile is None or not profile.mixed or stats.iterations <= 0 or not stats.mean_iteration_ms or budget <= 0:
        return None
    tokens = stats.budget_utilisation * budget
    if tokens < 1:
        return None
    total_rate = stats.decode_tokens_per_s + stats.prefill_tokens_per_s
    decode_share = stats.decode_tokens_per_s / total_rate if total_rate > 0 else 0.0
    if decode_share >= 0.9 and profile.decode_only:
        kind, predicted = "decode", decode_ms_at(profile, max(1, round(tokens)))
    elif stats.budget_utilisation >= _CALIBRATE_ABOVE_UTILISATION:
        kind, predicted = "mixed", profile.iteration_ms_at(round(tokens))
    else:
        return None
    if predicted <= 0:
        return None
    return kind, min(20.0, max(0.25, stats.mean_iteration_ms / predicted))


def decode_ms_at(profile: Profile, num_decodes: int) -> float:
    """The profile's decode-only iteration for a batch of `num_decodes` (contracts.Profile.decode_ms_at)."""
    return profile.decode_ms_at(num_decodes)


def largest_decodes_within(profile: Profile, target_ms: float, cal: float, lo: int, hi: int) -> int | None:
    """Largest batch of decodes in [lo, hi] whose calibrated decode-only iteration fits `target_ms`."""
    return profile.decode_curve.largest_x_within(target_ms / cal, lo, hi)
