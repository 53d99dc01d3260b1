"""What became of each objective's requests at the router: p99 TTFT and queue wait over a recent window, and
counts of requests judged and of those good. Pure and clock-free (times are passed in).

Goodput has one definition (`good`): a request is good when it was served within every target of its objective
that was measured (stallfree.latency.within_targets); a request shed, refused, answered without a replica or
failed by its replica (a 5xx or 429) is judged and not good; one its replica turned away as malformed (any other
4xx) is not judged. The router measures the queue wait and the first byte, so its `good` is "queue wait and
TTFT within their targets"; TPOT is the engine's (the daemons' windows judge it). The operator's control loop
reads these in `/router/queue` (observe_router.py) so that its breach verdict, its sizing and
`status.control.objectives` see each objective on its own (a batch objective's long waits are not the interactive
one's breach); the simulator's router reads them the same way.
"""
from __future__ import annotations

from collections import deque

from stallfree.contracts import percentile
from stallfree.latency import within_targets
from stallfree.operator.router.objectives import Objective

# The p99s are over the requests answered in the last this many seconds (the control loop's default window).
WINDOW_S = 30.0


class ObjectiveOutcomes:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window must be positive, got {window_s!r}")
        self.window_s = window_s
        self._ttft: dict[str, deque[tuple[float, float]]] = {}  # objective -> (time, TTFT ms)
        self._wait: dict[str, deque[tuple[float, float]]] = {}  # objective -> (time, queue wait ms)
        self.completed: dict[str, int] = {}  # judged (answered, or refused once queued), since the router started
        self.good: dict[str, int] = {}  # of those, within their objective's targets

    def first_byte(self, objective: Objective, t: float, ttft_ms: float, queue_wait_ms: float | None) -> None:
        _append(self._ttft, objective.name, t, ttft_ms, self.window_s)
        self.completed[objective.name] = self.completed.get(objective.name, 0) + 1
        if good(objective, ttft_ms, queue_wait_ms):
            self.good[objective.name] = self.good.get(objective.name, 0) + 1

    def unserved(self, objective: str) -> None:
        """Answered without a replica (the queue full, timed out, no replica could take it, or lost): not good."""
        self.completed[objective] = self.completed.get(objective, 0) + 1

    def dispatched(self, objective: str, t: float, wait_ms: float) -> None:
        _append(self._wait, objective, t, wait_ms, self.window_s)

    def figures(self, objective: str, now: float) -> dict[str, float | int | None]:
        """Its counters, and its p99s over the window (None: nothing in it)."""
        return {"completed": self.completed.get(objective, 0), "good": self.good.get(objective, 0),
                "p99_ttft_ms": _p99(self._ttft.get(objective), now - self.window_s),
                "p99_queue_wait_ms": _p99(self._wait.get(objective), now - self.window_s)}


def good(objective: Objective, ttft_ms: float | None, queue_wait_ms: float | None,
         tpot_ms: float | None = None) -> bool:
    """Served within every target of `objective` (None: not measured; a TPOT not measured cannot miss)."""
    return within_targets(ttft_ms, tpot_ms, queue_wait_ms, ttft_target_ms=objective.ttft_ms,
                          tpot_target_ms=objective.tpot_ms, queue_wait_target_ms=objective.queue_wait_ms)


def _append(by_objective: dict[str, deque[tuple[float, float]]], objective: str, t: float, value: float,
            window_s: float) -> None:
    samples = by_objective.setdefault(objective, deque())
    samples.append((t, value))
    while samples and samples[0][0] <= t - window_s:
        samples.popleft()  # bounded by the window's requests


def _p99(samples: deque[tuple[float, float]] | None, since: float) -> float | None:
    values = sorted(v for t, v in samples or () if t > since)
    return percentile(values, 0.99) if values else None
