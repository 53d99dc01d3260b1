"""Each replica's speed, learned from its windows: the start-up profile is a prior, never the truth.

A profile is measured once, alone, on short contexts, or read from a cache keyed by another machine; then
a noisy neighbour arrives, or the node is slower than its twin. Every window whose iterations can tell
(profile_rules.observed_over_predicted: mostly decodes, or a budget at least half used) gives the observed mean
iteration over the profile's prediction; the loop keeps an exponential mean of those per replica (decode
and mixed iterations apart) and hands the tuner, feasibility, the scaler and the capacity figure the
profile scaled by it. A window that cannot tell (idle, lightly used) keeps what was learned instead of
falling back to the profile, so a replica faster than its profile is not under-counted once its load
drops below half its budget. The profile is calibrated here once: its users take it as it is (dividing it by
a window's ratio again would undo the mean, leaving only the newest window).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from stallfree.contracts import Profile, WindowStats
from stallfree.profile_rules import observed_over_predicted, scaled

WEIGHT = 0.5  # of the newest telling window: a slowdown shows within two windows, one odd window moves it half


@dataclass(frozen=True)
class LearnedSpeed:
    """Observed iteration time over the profile's, for decode-only and mixed iterations (None: not seen)."""

    decode: float | None = None
    mixed: float | None = None

    def updated(self, stats: WindowStats | None, profile: Profile | None) -> "LearnedSpeed":
        seen = observed_over_predicted(stats, profile) if stats is not None else None
        if seen is None:
            return self
        kind, ratio = seen
        old = getattr(self, kind)
        return replace(self, **{kind: ratio if old is None else WEIGHT * ratio + (1 - WEIGHT) * old})

    def apply(self, profile: Profile | None) -> Profile | None:
        """The profile as this replica runs now. Mixed iterations are never taken faster than decode-only ones
        were seen to be slower (a long prefix only adds work)."""
        if profile is None or (self.decode is None and self.mixed is None):
            return profile
        mixed = self.mixed if self.mixed is not None else self.decode
        decode = self.decode if self.decode is not None else mixed
        return scaled(profile, decode, mixed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LearnedSpeed":
        return cls(decode=data.get("decode"), mixed=data.get("mixed"))

