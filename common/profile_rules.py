"""The rules every part derives from a profile, in one place. Pure: no torch, no I/O.

The daemon's start, `/admin/profile`, the tuner, feasibility, the scaler, the router, the demo, the oracle and
the benchmarks all ask the same four questions of a profile; each has one answer here:
- the token budget for a TPOT target (`budget_for_tpot`);
- max_num_seqs giving way to the budget's prefill floor (`give_way`);
- prefill capacity: prompt tokens/s beside the running decodes (`prefill_room`, `prefill_tokens_per_s`);
- how much slower than its profile a replica ran a window (`observed_over_predicted`), and the profile as it
  runs now (`scaled`). A profile is calibrated once: whoever scales it must not divide by a window again.
"""
from __future__ import annotations

from dataclasses import replace

from stallfree.contracts import Profile, WindowStats, min_budget_for

# Served iterations must fit this share of the TPOT target: the profile is its fastest run, served iterations
# carry longer contexts and noise, and the p99 gap (not the typical one) must hold.
SLO_MARGIN = 0.8
# The smallest live budget by default: below it an iteration is mostly fixed overhead, so TPOT gains nothing.
MIN_TOKEN_BUDGET = 64
# A calibration outside this range is a broken window (a stall, a clock jump), not a speed.
CALIBRATION_RANGE = (0.25, 20.0)
# Below this budget use a mixed iteration is mostly fixed overhead: its time says little about the curve.
CALIBRATE_ABOVE_UTILISATION = 0.5
# At least this share of a window's tokens decodes: compare it with the decode-only curve.
DECODE_WINDOW_SHARE = 0.9


def budget_for_tpot(profile: Profile, tpot_target_ms: float, lo: int = MIN_TOKEN_BUDGET, hi: int = 1 << 16,
                    margin: float = SLO_MARGIN) -> int:
    """Sarathi-Serve's recipe: the largest measured budget whose iteration fits `margin` of the target, else the
    smallest measured one (below it the curve is flat: a smaller budget is predicted no faster), kept in
    [lo, hi] (hi wins over lo). Measured points only: what was timed, not what a line between them says."""
    curve = profile.mixed_curve
    best = curve.largest_point_within(margin * tpot_target_ms)
    lo = min(lo, hi)
    return max(lo, min(hi, int(curve.xs[0] if best is None else best)))


def give_way(token_budget: int, max_num_seqs: int, min_num_seqs: int, max_token_budget: int) -> tuple[int, int]:
    """(budget, max_num_seqs) with the budget at least min_budget_for(max_num_seqs): max_num_seqs comes down
    first (not below `min_num_seqs`), then the budget rises to the floor, never past `max_token_budget`.
    A budget under its sequences' floor leaves decodes no prefill room: prompts would starve."""
    seqs = max_num_seqs
    while seqs > min_num_seqs and min_budget_for(seqs) > token_budget:
        seqs -= 1
    return max(token_budget, min(max_token_budget, min_budget_for(seqs))), seqs


def decodes_per_iteration(stats: WindowStats) -> float:
    """Mean decode tokens in a busy iteration of the window (its running count when it decoded nothing)."""
    total = stats.decode_tokens_per_s + stats.prefill_tokens_per_s
    if total <= 0:
        return float(stats.num_running)
    return stats.budget_utilisation * stats.tuning.token_budget * stats.decode_tokens_per_s / total


def prefill_room(budget: int, decodes: float) -> float:
    """Tokens of an iteration left for prompts: every running decode takes its token first."""
    return max(0.0, budget - decodes)


def prefill_tokens_per_s(profile: Profile, budget: int, decodes: float) -> float | None:
    """Prompt tokens/s at `budget` beside `decodes` decodes per iteration, each iteration the profile's time
    for the full budget (None when the profile says an iteration takes no time)."""
    iteration_ms = profile.iteration_ms_at(budget)
    if iteration_ms <= 0:
        return None
    return prefill_room(budget, decodes) / (iteration_ms / 1000.0)


def observed_over_predicted(stats: WindowStats, profile: Profile | None) -> tuple[str, float] | None:
    """("decode" | "mixed", the window's mean iteration over the profile's for the tokens it ran), or None when
    the window cannot tell (idle, no profile, a mixed window under half its budget)."""
    budget = stats.tuning.token_budget
    if profile is None or not profile.mixed or stats.iterations <= 0 or not stats.mean_iteration_ms or budget <= 0:
        return None
    tokens = stats.budget_utilisation * budget
    if tokens < 1:
        return None
    total_rate = stats.decode_tokens_per_s + stats.prefill_tokens_per_s
    decode_share = stats.decode_tokens_per_s / total_rate if total_rate > 0 else 0.0
    if decode_share >= DECODE_WINDOW_SHARE and profile.decode_only:
        kind, predicted = "decode", profile.decode_ms_at(max(1, round(tokens)))
    elif stats.budget_utilisation >= CALIBRATE_ABOVE_UTILISATION:
        kind, predicted = "mixed", profile.iteration_ms_at(round(tokens))
    else:
        return None
    if predicted <= 0:
        return None
    low, high = CALIBRATION_RANGE
    return kind, min(high, max(low, stats.mean_iteration_ms / predicted))


def scaled(profile: Profile, factor: float, mixed_factor: float | None = None) -> Profile:
    """The profile with every decode-only iteration `factor` x as long and every mixed one `mixed_factor` x
    (default `factor`): what a calibration says this machine does now."""
    mixed = factor if mixed_factor is None else mixed_factor
    return replace(profile, decode_only=[replace(p, iteration_ms=factor * p.iteration_ms) for p in profile.decode_only],
                   mixed=[replace(p, iteration_ms=mixed * p.iteration_ms) for p in profile.mixed])


def calibrated_by(stats: WindowStats | None, profile: Profile | None) -> Profile | None:
    """The profile scaled by what one window observed (for callers with no memory of earlier windows, like
    the router); the profile itself when the window cannot tell."""
    seen = observed_over_predicted(stats, profile) if stats is not None else None
    if seen is None:
        return profile
    # One window's ratio moves both curves, as the loop's learned speed does until it has seen both kinds.
    return scaled(profile, seen[1])
