"""Exact sliding-window statistics of one engine: what /admin/stats returns to the operator's control loop.

An EngineObserver that keeps every TTFT, TPOT, ITL and queue-wait sample of the last `window_s` seconds
and computes exact nearest-rank percentiles on demand (the tuner decides on p99 TPOT: bucket
interpolation would blur exactly the tail it steers by). Appends happen on the engine thread, snapshots
on the HTTP thread; a lock guards both, pruning runs once per iteration so the per-token path stays an
append.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from stallfree import latency
from stallfree.contracts import Ceilings, Percentiles, Tuning, WindowStats, percentile
from stallfree.node_daemon.engine.engine_protocol import IterationRecord
from stallfree.node_daemon.engine.request import Request


def percentiles_ms(samples_s: list[float]) -> Percentiles:
    """Exact nearest-rank p50/p90/p99/max of samples in seconds, reported in milliseconds."""
    n = len(samples_s)
    if n == 0:
        return Percentiles()
    ordered = np.sort(np.asarray(samples_s, dtype=np.float64))  # releases the GIL while it sorts

    def rank(q: float) -> float:
        return float(percentile(ordered, q)) * 1000.0

    return Percentiles(count=n, p50=rank(0.50), p90=rank(0.90), p99=rank(0.99), max=float(ordered[-1]) * 1000.0)


class StatsWindow:
    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"stats window must be positive, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        # (time, seconds) samples
        self._ttft: deque[tuple[float, float]] = deque()
        self._tpot: deque[tuple[float, float]] = deque()
        self._itl: deque[tuple[float, float]] = deque()
        self._queue_wait: deque[tuple[float, float]] = deque()
        # (end time, prefill tokens, decode tokens, budget, duration_s, preempted)
        self._iterations: deque[tuple[float, int, int, int, float, int]] = deque()
        # (finish time, prompt tokens, output tokens)
        self._finished: deque[tuple[float, int, int]] = deque()
        # (arrival time, prompt tokens): demand, refused arrivals included
        self._arrivals: deque[tuple[float, int]] = deque()
        self._last: IterationRecord | None = None
        self._prefill_rate = (float("-inf"), 0.0)  # (computed at, tokens/s): Retry-After asks often

    # --- EngineObserver (engine thread) ---

    def on_iteration(self, record: IterationRecord) -> None:
        end = record.start + record.duration_s
        with self._lock:
            # A verification's draft tokens are the decodes' work inside the budget: the tuner sees the budget they use.
            self._iterations.append((end, record.num_prefill_tokens,
                                     record.num_decode_tokens + record.num_verify_tokens,
                                     record.token_budget, record.duration_s, record.num_preempted))
            self._last = record
            self._prune(end)

    def on_token(self, request: Request, now: float, first: bool) -> None:
        with self._lock:
            if first:
                self._ttft.append((now, latency.ttft_s(request.arrival_time, now)))
                queue_wait = latency.queue_wait_s(request.arrival_time, request.first_scheduled_time)
                if queue_wait is not None:
                    self._queue_wait.append((now, queue_wait))
            elif request.last_token_time is not None:
                # The engine updates last_token_time after notifying observers: it holds the previous token.
                self._itl.append((now, latency.itl_s(request.last_token_time, now)))

    def on_finished(self, request: Request, now: float) -> None:
        num_output = request.num_output_tokens
        with self._lock:
            self._finished.append((now, request.num_prompt_tokens, num_output))
            tpot = latency.tpot_s(request.first_token_time, request.last_token_time, num_output)
            if tpot is not None:
                self._tpot.append((now, tpot))

    # --- server side ---

    def on_arrival(self, num_prompt_tokens: int, now: float | None = None) -> None:
        """A validated request arrived (also when backpressure refuses it: that is still demand)."""
        with self._lock:
            self._arrivals.append((self._clock() if now is None else now, num_prompt_tokens))

    def prefill_tokens_per_s(self) -> float:
        """Prefill tokens computed per second over the window, recomputed at most once a second."""
        now = self._clock()
        at, rate = self._prefill_rate
        if now - at < 1.0:
            return rate
        with self._lock:
            self._prune(now)
            total = sum(it[1] for it in self._iterations)
        rate = total / max(1e-9, min(self.window_s, now - self._started))
        self._prefill_rate = (now, rate)
        return rate

    def snapshot(
        self,
        tuning: Tuning,
        ceilings: Ceilings,
        now: float | None = None,
        num_waiting: int | None = None,
        num_running: int | None = None,
        kv_usage: float | None = None,
    ) -> WindowStats:
        """The window's statistics; live counts passed in win over the last iteration's (stale when idle)."""
        now = self._clock() if now is None else now
        with self._lock:
            self._prune(now)
            ttft = [v for _, v in self._ttft]
            tpot = [v for _, v in self._tpot]
            itl = [v for _, v in self._itl]
            queue_wait = [v for _, v in self._queue_wait]
            iterations = list(self._iterations)
            finished = list(self._finished)
            arrivals = list(self._arrivals)
            num_first_tokens = len(self._ttft)
            last = self._last
        span = max(1e-9, min(self.window_s, now - self._started))
        busy = [(p + d) / b for _, p, d, b, _, _ in iterations if p + d > 0 and b > 0]
        return WindowStats(
            window_s=self.window_s,
            ttft_ms=percentiles_ms(ttft),
            tpot_ms=percentiles_ms(tpot),
            itl_ms=percentiles_ms(itl),
            queue_wait_ms=percentiles_ms(queue_wait),
            request_rate=len(finished) / span,
            prompt_tokens_per_s=sum(n for _, n in arrivals) / span,
            generation_tokens_per_s=(len(itl) + num_first_tokens) / span,
            prefill_tokens_per_s=sum(it[1] for it in iterations) / span,
            decode_tokens_per_s=sum(it[2] for it in iterations) / span,
            budget_utilisation=sum(busy) / len(busy) if busy else 0.0,
            kv_usage=kv_usage if kv_usage is not None else (last.kv_usage if last else 0.0),
            preemptions=sum(it[5] for it in iterations),
            num_waiting=num_waiting if num_waiting is not None else (last.num_waiting if last else 0),
            num_running=num_running if num_running is not None else (last.num_running if last else 0),
            tuning=tuning,
            ceilings=ceilings,
            iterations=len(iterations),
            mean_iteration_ms=(sum(it[4] for it in iterations) / len(iterations) * 1000.0) if iterations else None,
        )

    def _prune(self, now: float) -> None:
        """Drop samples older than the window (caller holds the lock)."""
        horizon = now - self.window_s
        for samples in (self._ttft, self._tpot, self._itl, self._queue_wait, self._iterations, self._finished,
                        self._arrivals):
            while samples and samples[0][0] < horizon:
                samples.popleft()
