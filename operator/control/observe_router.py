"""The router's queue as the control loop reads it: `GET /router/queue` (or the in-process router's own).

The router reports counters (requests and prompt tokens that arrived); rates come from two readings: over
the stats window (the demand) and over the last control interval (the panic window's). A router that
restarted (its counters went back) starts the readings afresh; one that cannot be read is no information.

Several router pods (two by default) each keep their own queue: a request waits in the one its connection
reached. The scaler sizes for their sum (summed_reader): depths, queued tokens and arrival counters add up,
the oldest wait is the oldest of any. A router that leaves takes its counters with it, which reads as a
restart (the rates start afresh), never as a burst.

Per objective (`objectives` in the router's answer) the same readings give each one's depth, its shed count over
the window and, where the router counts them per objective (`offered`, `offered_prompt_tokens`: shed ones
included), its arrival rates, its requests judged and good (`completed`, `good`: objective_outcomes.py) and its p99
TTFT and queue wait over the router's own window (objective_outcomes.py; several routers: the worst one's), which
the breach verdict then judges per objective; a figure the router does not give stays unknown (None), and the loop
then sizes as without objectives.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Awaitable, Callable

import httpx

from stallfree.operator.control.observe import ObjectiveWindow, QueueObservation
from stallfree.operator.control.queueing import prompt_cv2

Reader = Callable[[], Awaitable[dict[str, Any] | None]]


class RouterQueueSource:
    def __init__(self, read: Reader | None, window_s: float) -> None:  # None: readings are handed to `take`
        self.read = read
        self.window_s = window_s
        self._raw: tuple[int, float] | None = None  # the last reading's arrival counters as the router gave them
        # (time, arrivals, arrived prompt tokens, their squares, per objective as the router gave it)
        self._readings: deque[tuple[float, int, float, float, dict[str, dict[str, Any]]]] = deque()

    async def observe_queue(self, now: float) -> QueueObservation | None:
        status = await self.read()
        return None if status is None else self.take(status, now)

    def take(self, status: dict[str, Any], now: float) -> QueueObservation:
        """One reading of `/router/queue` at `now`, with the earlier ones: what the control loop sees."""
        raw_arrivals, raw_tokens = int(status["arrivals"]), float(status["arrived_prompt_tokens"])
        squares = float(status.get("arrived_prompt_tokens_sq", 0.0))  # a router of an earlier release lacks it
        if self._raw is not None and (raw_arrivals < self._raw[0] or raw_tokens < self._raw[1]):
            self._readings.clear()  # the router restarted: its counters began again
        self._raw = (raw_arrivals, raw_tokens)
        # Demand is what the replicas accepted: arrivals a replica refused at once (junk) are taken out.
        arrivals = raw_arrivals - int(status.get("refused_by_replica", 0))
        tokens = raw_tokens - float(status.get("refused_prompt_tokens", 0.0))
        squares -= float(status.get("refused_prompt_tokens_sq", 0.0))
        per_objective = status.get("objectives")
        per_objective = per_objective if isinstance(per_objective, dict) else {}
        self._readings.append((now, arrivals, tokens, squares, per_objective))
        while len(self._readings) > 2 and self._readings[1][0] <= now - self.window_s:
            self._readings.popleft()
        first, last = self._readings[0], self._readings[-1]
        span = last[0] - first[0]
        rate = max(0.0, last[2] - first[2]) / span if span > 0 else 0.0  # refusals may trail their arrivals
        previous = self._readings[-2] if len(self._readings) > 1 else last
        count = max(0, last[1] - first[1])
        cv2 = prompt_cv2(count, last[2] - first[2], last[3] - first[3]) if last[3] > 0 else None
        return QueueObservation(depth=int(status["depth"]), queued_prompt_tokens=float(status["queued_prompt_tokens"]),
                                oldest_wait_ms=float(status["oldest_wait_ms"]), arrival_prompt_tokens_per_s=rate,
                                recent_prompt_tokens=max(0.0, last[2] - previous[2]),
                                recent_requests=max(0, last[1] - previous[1]),
                                recent_s=last[0] - previous[0], arrival_requests_per_s=count / span if span > 0 else 0.0,
                                prompt_cv2=cv2, objectives=objective_windows(first[4], previous[4], last[4], span))


def objective_windows(first: dict[str, dict[str, Any]], previous: dict[str, dict[str, Any]],
                      last: dict[str, dict[str, Any]], span: float) -> tuple[ObjectiveWindow, ...]:
    """Each objective's window from three readings of the router's per-objective counters (the window's first,
    the last interval's start, now)."""
    out = []
    for name, now in sorted(last.items()):
        if not isinstance(now, dict):
            continue
        start, before = first.get(name) or {}, previous.get(name) or {}

        def grew(key: str, since: dict[str, Any]) -> float:
            return max(0.0, float(now.get(key, 0.0)) - float(since.get(key, 0.0)))

        counted = "offered_prompt_tokens" in now and "offered" in now
        out.append(ObjectiveWindow(
            str(name), int(now.get("priority", 0)),
            arrival_prompt_tokens_per_s=(grew("offered_prompt_tokens", start) / span if span > 0 else 0.0)
            if counted else None,
            recent_prompt_tokens=grew("offered_prompt_tokens", before) if counted else 0.0,
            recent_requests=int(grew("offered", before)) if counted else 0,
            arrival_requests_per_s=grew("offered", start) / span if counted and span > 0 else 0.0,
            depth=int(now.get("depth", 0)), queued_prompt_tokens=float(now.get("queued_prompt_tokens", 0.0)),
            oldest_wait_ms=float(now.get("oldest_wait_ms", 0.0)), shed=int(grew("shed", start)),
            completed=int(grew("completed", start)), good=int(grew("good", start)),
            ttft_p99_ms=_ms(now.get("p99_ttft_ms")), queue_wait_p99_ms=_ms(now.get("p99_queue_wait_ms"))))
    return tuple(out)


_SUMMED = ("depth", "queued_prompt_tokens", "arrivals", "arrived_prompt_tokens", "arrived_prompt_tokens_sq",
           "refused_by_replica", "refused_prompt_tokens", "refused_prompt_tokens_sq")


def summed_reader(readers: Callable[[], Awaitable[list[Reader]]]) -> Reader:
    """One reading of every router `readers()` names now, added up; None when none answers."""
    async def read() -> dict[str, Any] | None:
        statuses = [s for s in [await r() for r in await readers()] if s is not None]
        if not statuses:
            return None
        total: dict[str, Any] = {key: sum(float(s.get(key, 0.0)) for s in statuses) for key in _SUMMED}
        total["depth"], total["arrivals"] = int(total["depth"]), int(total["arrivals"])
        total["oldest_wait_ms"] = max(float(s["oldest_wait_ms"]) for s in statuses)
        total["routers"] = len(statuses)
        total["objectives"] = _summed_objectives([s.get("objectives") or {} for s in statuses])
        return total

    return read


_SUMMED_PER_OBJECTIVE = ("depth", "queued_prompt_tokens", "shed", "offered", "offered_prompt_tokens", "completed",
                         "good")
# Each router's p99 over its own requests: the service's is taken as the worst of them (a bound, not a merge).
_WORST_PER_OBJECTIVE = ("p99_ttft_ms", "p99_queue_wait_ms")


def _ms(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _summed_objectives(per_router: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The routers' per-objective figures added up (the oldest wait the oldest of any); a counter only where every
    router that reports the objective gives it."""
    out: dict[str, dict[str, Any]] = {}
    for objectives in per_router:
        for name, figures in objectives.items() if isinstance(objectives, dict) else ():
            if not isinstance(figures, dict):
                continue
            seen = name in out
            total = out.setdefault(name, {"priority": figures.get("priority", 0)})
            for key in _SUMMED_PER_OBJECTIVE:
                if key in figures and (not seen or key in total):
                    total[key] = total.get(key, 0.0) + float(figures[key])
                elif seen:
                    total.pop(key, None)
            total["oldest_wait_ms"] = max(total.get("oldest_wait_ms", 0.0), float(figures.get("oldest_wait_ms", 0.0)))
            for key in _WORST_PER_OBJECTIVE:
                values = [v for v in (_ms(total.get(key)), _ms(figures.get(key))) if v is not None]
                if values:
                    total[key] = max(values)
    return out


def http_queue_reader(client: httpx.AsyncClient, base_url: str, timeout_s: float,
                      admin_token: str | None = None) -> Reader:
    """Reads `base_url`/router/queue (with the admin token: a router shows its queue to no one else); None when
    the router cannot be reached or answers oddly."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    async def read() -> dict[str, Any] | None:
        try:
            response = await client.get(base_url.rstrip("/") + "/router/queue", timeout=timeout_s, headers=headers)
            response.raise_for_status()
            body = response.json()
            return body if isinstance(body, dict) and "depth" in body else None
        except (httpx.HTTPError, ValueError):
            return None

    return read
