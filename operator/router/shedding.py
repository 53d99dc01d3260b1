"""Shedding before waiting: a sheddable request predicted to miss its TTFT target everywhere is refused at arrival.

A request of a sheddable objective (priority < 0) that would wait and then miss is worse than one refused at
once: it held a place in the queue, and its client learns nothing until too late. At arrival its TTFT is
predicted as pick.py predicts it on each healthy replica (the prefill queued there, its prompt, a step), plus
the prompt tokens waiting in the router ahead of it (its band and above) drained at the replicas' summed
prefill rate; the whole wait stretched by what the higher bands' arrivals take of that rate (they go first, in the
router's queue and in the engine's, so they slow the wait: without that share a batch band predicted at its target
waits past it by the interactive load's factor). It is shed only when
that misses the target at every replica, counting the replicas already starting: each joins the prefill rate
when it is expected ready (startup_times.py: the start-ups the router has seen), and may start the request
itself then. Pure: views in, verdict out; `BandArrivals` keeps the recent arrivals per band, with the times it
is handed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from stallfree.operator.router.objectives import Objective
from stallfree.operator.router.pick import ReplicaView, predict_ttft_ms

SHED_CODE = "shed_predicted_miss"


# The higher bands' arrivals are counted at their mean plus this many standard deviations over the wait: a batch
# request admitted at its target waits past it whenever the interactive load runs above its mean.
RESERVE_DEVIATIONS = 3.0
# ... and over its wait on the replica (its share of what is queued there, and its own prompt), this many: that
# wait is short, and at 3 a batch objective with a tight target was shed almost whole even with capacity to spare.
REPLICA_RESERVE_DEVIATIONS = 1.5


@dataclass(frozen=True)
class Reserve:
    """What the higher bands may take of the prefill (tokens/ms): over the router's queue ahead, and on a replica."""

    router: float = 0.0
    replica: float = 0.0


NO_RESERVE = Reserve()


def reserved_tokens_per_ms(requests: int, tokens: float, tokens_sq: float, window_s: float, horizon_s: float,
                           deviations: float = RESERVE_DEVIATIONS) -> float:
    """The prefill rate the higher bands may take over the next `horizon_s` (a band's TTFT target): their arrival
    rate over the last `window_s` (`requests` of `tokens` prompt tokens, `tokens_sq` their squares) plus
    `deviations` standard deviations of the difference between the rate ahead and that estimate (a Poisson
    stream's token count over the horizon, and over the window the estimate was taken on)."""
    if requests <= 0 or window_s <= 0 or horizon_s <= 0:
        return 0.0
    mean = tokens / window_s
    spread = (tokens_sq / window_s * (1.0 / horizon_s + 1.0 / window_s)) ** 0.5
    return (mean + deviations * spread) / 1000.0


# How far back the bands' arrivals are counted for the reserve.
RESERVE_WINDOW_S = 30.0


class BandArrivals:
    """The prompt tokens each priority band offered over the last `window_s` (clock-free: times are passed in), for
    the reserve a lower band's wait is predicted with."""

    def __init__(self, window_s: float = RESERVE_WINDOW_S) -> None:
        self.window_s = window_s
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, priority, prompt tokens)
        self._first: float | None = None

    def offered(self, t: float, priority: int, prompt_tokens: int) -> None:
        self._first = t if self._first is None else self._first
        self._recent.append((t, priority, prompt_tokens))
        self._forget_before(t - self.window_s)  # bounded by the window's arrivals, sheddable ones or not

    def reserved_tokens_per_ms(self, priority: int, now: float, horizon_s: float,
                               deviations: float = RESERVE_DEVIATIONS) -> float:
        """What the bands above `priority` may take of the prefill over `horizon_s` (reserved_tokens_per_ms)."""
        self._forget_before(now - self.window_s)
        above = [n for _, p, n in self._recent if p > priority]
        span = min(self.window_s, now - self._first) if self._first is not None else 0.0
        return reserved_tokens_per_ms(len(above), float(sum(above)), float(sum(n * n for n in above)), span,
                                      horizon_s, deviations)

    def reserve(self, priority: int, now: float, horizon_s: float) -> Reserve:
        """The reserve a request of `priority` with a TTFT target of `horizon_s` is predicted with."""
        return Reserve(self.reserved_tokens_per_ms(priority, now, horizon_s),
                       self.reserved_tokens_per_ms(priority, now, horizon_s, REPLICA_RESERVE_DEVIATIONS))

    def __len__(self) -> int:
        return len(self._recent)

    def _forget_before(self, t: float) -> None:
        while self._recent and self._recent[0][0] <= t:
            self._recent.popleft()


def predicted_ttft_ms(views: list[ReplicaView], prompt_tokens: int, tokens_ahead: int,
                      reserve: Reserve = NO_RESERVE, starting_in_ms: Sequence[float] = ()) -> float | None:
    """The soonest predicted TTFT over `views` with `tokens_ahead` waiting in the router first. All of the wait,
    the prefill queued at the replica as much as the router's, drains at the prefill rate less the higher bands'
    `reserve` (they pass it on the replica too: the engine serves them first). A replica still starting
    (`starting_in_ms`: when each is expected ready) joins that rate then, at the ready replicas' mean rate, and
    may start the request itself then. None: no ready replica to predict from."""
    if not views:
        return None
    total_rate = sum(max(v.prefill_tokens_per_ms, 1e-6) for v in views)
    free_rate = max(total_rate - max(0.0, reserve.router), 1e-6)
    stretch = total_rate / max(total_rate - max(0.0, reserve.replica), 1e-6)
    each = free_rate / len(views)  # what a starting replica adds to the free rate once ready
    drained = drain_ms(tokens_ahead, free_rate, [(t, each) for t in starting_in_ms])
    at_replica = min((predict_ttft_ms(v, prompt_tokens) - v.step_ms) * stretch + v.step_ms for v in views)
    soonest = at_replica + drained
    if starting_in_ms:
        step = sum(v.step_ms for v in views) / len(views)
        soonest = min(soonest, max(min(starting_in_ms), drained) + prompt_tokens / each + step)
    return soonest


def backlog_drain_ms(views: list[ReplicaView], tokens_ahead: int) -> float:
    """How long the backlog there is now takes to drain at the ready replicas' full rates: the router's queue ahead
    over all of them, then the least-loaded replica's queued prefill. A shed request retried after this meets
    none of today's backlog (0 with no ready replica: nothing is known, a retry soon is as good as any)."""
    if not views:
        return 0.0
    total = sum(max(v.prefill_tokens_per_ms, 1e-6) for v in views)
    return max(0, tokens_ahead) / total + min(v.queued_prefill_tokens / max(v.prefill_tokens_per_ms, 1e-6)
                                              for v in views)


def drain_ms(tokens: float, rate: float, joining: Sequence[tuple[float, float]]) -> float:
    """How long `tokens` take at `rate` tokens/ms, plus each (at ms, rate) of `joining` from its time on."""
    t, left = 0.0, max(0.0, tokens)
    for at, extra in sorted(joining):
        if left <= rate * (at - t):
            break
        if at > t:
            left -= rate * (at - t)
            t = at
        rate += extra
    return t + left / rate


def sheds(objective: Objective, views: list[ReplicaView], starting_in_ms: Sequence[float], prompt_tokens: int,
          tokens_ahead: int, reserve: Reserve = NO_RESERVE) -> float | None:
    """The predicted TTFT (ms) when this request is to be refused at arrival, else None (it waits)."""
    if not objective.sheddable or objective.ttft_ms is None:
        return None
    predicted = predicted_ttft_ms(views, prompt_tokens, tokens_ahead, reserve, starting_in_ms)
    if predicted is None or predicted <= objective.ttft_ms:
        return None
    return predicted
