"""How long a replica takes to start, from the start-ups seen last: one rule for the scaler (when the replicas it
asks for now are ready) and the router (when a replica still starting takes requests)."""
from __future__ import annotations

from typing import Sequence

# How many of the latest start-ups are kept.
KEEP = 5


def expected_startup_s(samples: Sequence[float], default: float) -> float:
    """The median of the recent start-ups (the upper one of an even count); `default` until one is seen."""
    ordered = sorted(samples)
    return ordered[len(ordered) // 2] if ordered else default
