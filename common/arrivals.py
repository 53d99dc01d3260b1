"""The one arrival generator: Poisson (or gamma-bursty) send times for every load the project makes.

The simulator's workloads and closed loop, the local demo's load, and the benchmarks all draw their gaps here, so a
seed means the same arrivals everywhere (one draw of `rng` per gap).
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterator


def next_gap(rate: float, rng: random.Random, burstiness: float = 1.0) -> float:
    """Seconds to the next arrival at `rate` per second. `burstiness` is the gamma shape: 1 is Poisson, below 1
    burstier at the same mean rate. A rate of 0 never arrives (inf); an infinite rate arrives at once (0)."""
    if rate < 0 or not burstiness > 0:
        raise ValueError(f"rate must be >= 0 and burstiness > 0, got rate={rate}, burstiness={burstiness}")
    if rate == 0:
        return math.inf
    if math.isinf(rate):
        return 0.0
    if burstiness == 1.0:
        return rng.expovariate(rate)
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))  # mean gap = shape * scale = 1 / rate


def arrival_times(rate: float, rng: random.Random, *, start: float = 0.0, end: float = math.inf,
                  count: int | None = None, first_at_start: bool = False,
                  burstiness: float = 1.0) -> Iterator[float]:
    """Arrival times in [start, end), at most `count` of them. The first arrives one gap after `start`, or at `start`
    itself with `first_at_start` (a benchmark that wants its first request at t=0)."""
    if count is None and math.isinf(end) and rate > 0:
        raise ValueError("an endless arrival stream: give `end` or `count`")
    t, sent = start, 0
    if first_at_start and (count is None or count > 0) and start < end:
        yield t
        sent = 1
    while count is None or sent < count:
        t += next_gap(rate, rng, burstiness)
        if t >= end:
            return
        yield t
        sent += 1
