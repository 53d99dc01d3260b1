"""What became of each objective's requests at the router: p99 TTFT and queue wait over a recent window, and
counts of requests answered and of those within their TTFT target. Pure and clock-free (times are passed in).

The operator's control loop reads them in `/router/queue` (observe_router.py) so that its breach verdict, its
sizing and `status.control.objectives` see each objective on its own (a batch objective's long waits are not the
interactive one's breach). The router sees a request's queue wait and its first byte; TPOT is the daemons' (their
windows judge it), so `good` here is "first byte within the objective's TTFT target".
"""
from __future__ import annotations

from collections import deque

from stallfree.contracts import percentile

# The p99s are over the requests answered in the last this many seconds (the control loop's default window).
WINDOW_S = 30.0


class ObjectiveOutcomes:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window must be positive, got {window_s!r}")
        self.window_s = window_s
        self._ttft: dict[str, deque[tuple[float, float]]] = {}  # objective -> (time, TTFT ms)
        self._wait: dict[str, deque[tuple[float, float]]] = {}  # objective -> (time, queue wait ms)
        self.completed: dict[str, int] = {}  # answered (a first byte), since the router started
        self.good: dict[str, int] = {}  # of those, within the objective's TTFT target

    def first_byte(self, objective: str, t: float, ttft_ms: float, target_ms: float | None) -> None:
        _append(self._ttft, objective, t, ttft_ms, self.window_s)
        self.completed[objective] = self.completed.get(objective, 0) + 1
        if target_ms is None or ttft_ms <= target_ms:
            self.good[objective] = self.good.get(objective, 0) + 1

    def dispatched(self, objective: str, t: float, wait_ms: float) -> None:
        _append(self._wait, objective, t, wait_ms, self.window_s)

    def figures(self, objective: str, now: float) -> dict[str, float | int | None]:
        """Its counters, and its p99s over the window (None: nothing in it)."""
        return {"completed": self.completed.get(objective, 0), "good": self.good.get(objective, 0),
                "p99_ttft_ms": _p99(self._ttft.get(objective), now - self.window_s),
                "p99_queue_wait_ms": _p99(self._wait.get(objective), now - self.window_s)}


def _append(by_objective: dict[str, deque[tuple[float, float]]], objective: str, t: float, value: float,
            window_s: float) -> None:
    samples = by_objective.setdefault(objective, deque())
    samples.append((t, value))
    while samples and samples[0][0] <= t - window_s:
        samples.popleft()  # bounded by the window's requests


def _p99(samples: deque[tuple[float, float]] | None, since: float) -> float | None:
    values = sorted(v for t, v in samples or () if t > since)
    return percentile(values, 0.99) if values else None
