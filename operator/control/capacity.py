"""Prefill capacity of one replica: prompt tokens per second it can prefill at its current token budget.

The figure is profile_rules.prefill_tokens_per_s at the window's budget beside its decodes, on the profile as
the caller hands it: the control loop hands the profile scaled by the speed it learned (learned_speed.py), the
router one scaled by the window it just read (profile_rules.calibrated_by). It is never calibrated again
here. Without a profile, only a window whose budget was fully used tells its own full-budget iteration time.
"""
from __future__ import annotations

from stallfree.contracts import Profile, WindowStats
from stallfree.profile_rules import decodes_per_iteration, prefill_room, prefill_tokens_per_s

FULL_UTILISATION = 0.85


def prefill_capacity_tokens_per_s(stats: WindowStats, profile: Profile | None) -> float | None:
    """Prefill tokens/s at the current budget and decode load, or None when the window cannot tell."""
    budget = stats.tuning.token_budget
    if stats.iterations <= 0 or not stats.mean_iteration_ms or budget <= 0:
        return None
    decodes = decodes_per_iteration(stats)
    if profile is not None and profile.mixed:
        return prefill_tokens_per_s(profile, budget, decodes)
    if stats.budget_utilisation >= FULL_UTILISATION:
        return prefill_room(budget, decodes) / (stats.mean_iteration_ms / 1000.0)
    return None

