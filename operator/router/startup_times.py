"""How long replicas take to start, as the router saw it, so shedding can count a replica that is still starting.

A replica is starting from the router's first sight of it until its first ready poll, when it was seen loading its
model on the way (one that answers ready at once was already up: no start-up to learn from). The expected start-up
is the scaler's rule over the last few seen (`stallfree.startup`); until one is seen, `default_s`. A starting
replica is counted as ready in the expected time less what it has already taken, and not at all once it has taken
twice the expected time (a start-up that long may never end: counting it would shed nothing for as long). Pure:
times are passed in.
"""
from __future__ import annotations

from collections import deque

from stallfree.startup import KEEP, expected_startup_s

DEFAULT_STARTUP_S = 60.0


class StartupTimes:
    def __init__(self, default_s: float = DEFAULT_STARTUP_S, keep: int = KEEP) -> None:
        if default_s <= 0:
            raise ValueError(f"the default start-up must be positive, got {default_s!r}")
        self.default_s = default_s
        self._seen: deque[float] = deque(maxlen=keep)

    def observed(self, seconds: float) -> None:
        if seconds > 0:
            self._seen.append(seconds)

    def expected_s(self) -> float:
        return expected_startup_s(self._seen, self.default_s)

    def ready_in_ms(self, elapsed_s: float) -> float | None:
        """When a replica starting for `elapsed_s` is expected ready, from now (ms); None: not to be counted."""
        expected = self.expected_s()
        if elapsed_s > 2 * expected:
            return None
        return max(0.0, expected - elapsed_s) * 1000.0
