"""StatsWindow: exact nearest-rank percentiles over a sliding window, rates and live counts."""
from __future__ import annotations

import math
import random

import pytest

from stallfree.contracts import Ceilings, Tuning, WindowStats
from stallfree.node_daemon.engine.engine_protocol import IterationRecord
from stallfree.node_daemon.engine.request import Request, RequestStatus
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.measure.stats_window import StatsWindow, percentiles_ms


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _record(start: float, prefill: int, decode: int, budget: int = 256, duration: float = 0.01,
            preempted: int = 0, kv: float = 0.5, waiting: int = 3, running: int = 4) -> IterationRecord:
    return IterationRecord(start=start, duration_s=duration, num_prefill_tokens=prefill, num_decode_tokens=decode,
                           token_budget=budget, max_num_seqs=64, num_running=running, num_waiting=waiting,
                           num_partial_prefills=1, kv_usage=kv, num_preempted=preempted)


def _stream(window: StatsWindow, rid: str, arrival: float, scheduled: float, token_times: list[float],
            prompt: int = 10) -> Request:
    """Drive one request through the observer the way the engine does (last_token_time set after notify)."""
    req = Request(rid, list(range(prompt)), SamplingParams(max_tokens=len(token_times)), arrival_time=arrival)
    req.first_scheduled_time = scheduled
    for i, t in enumerate(token_times):
        window.on_token(req, t, first=(i == 0))
        req.append_output_token(1)
        if i == 0:
            req.first_token_time = t
        req.last_token_time = t
    req.status = RequestStatus.FINISHED_LENGTH
    req.finished_time = token_times[-1]
    window.on_finished(req, token_times[-1])
    return req


def test_percentiles_are_exact_nearest_rank() -> None:
    samples = [i / 1000.0 for i in range(1, 101)]  # 1..100 ms
    random.Random(0).shuffle(samples)
    p = percentiles_ms(samples)
    assert p.count == 100
    assert p.p50 == pytest.approx(50.0)
    assert p.p90 == pytest.approx(90.0)
    assert p.p99 == pytest.approx(99.0)
    assert p.max == pytest.approx(100.0)
    one = percentiles_ms([0.007])
    assert (one.p50, one.p99, one.max) == (pytest.approx(7.0),) * 3
    assert percentiles_ms([]).p99 is None


def test_one_stall_shows_in_p99_and_max_not_p50() -> None:
    clock = Clock(0.0)
    window = StatsWindow(window_s=60.0, clock=clock)
    times = [1.0 + 0.01 * i for i in range(100)]  # 10 ms gaps
    times[50:] = [t + 0.5 for t in times[50:]]  # one 510 ms gap
    _stream(window, "a", arrival=0.9, scheduled=0.95, token_times=times)
    clock.t = 3.0
    stats = window.snapshot(Tuning(), Ceilings())
    assert stats.itl_ms.count == 99
    assert stats.itl_ms.p50 == pytest.approx(10.0)
    assert stats.itl_ms.max == pytest.approx(510.0)
    assert stats.itl_ms.p99 == pytest.approx(510.0)  # rank ceil(0.99*99)=99: the single largest gap
    assert stats.ttft_ms.p50 == pytest.approx(100.0)
    assert stats.queue_wait_ms.p50 == pytest.approx(50.0)
    # TPOT of the request: (last - first) / (n - 1)
    assert stats.tpot_ms.p50 == pytest.approx((times[-1] - times[0]) / 99 * 1000.0)


def test_window_forgets_old_samples_and_reports_rates() -> None:
    clock = Clock(0.0)
    window = StatsWindow(window_s=10.0, clock=clock)
    window.on_arrival(100, now=1.0)
    _stream(window, "old", arrival=1.0, scheduled=1.0, token_times=[1.5, 1.6, 1.7], prompt=100)
    for k in range(20):
        window.on_iteration(_record(start=1.0 + 0.05 * k, prefill=200, decode=4, duration=0.04, preempted=k % 2))
    clock.t = 5.0
    early = window.snapshot(Tuning(), Ceilings())
    assert early.ttft_ms.count == 1 and early.tpot_ms.count == 1 and early.itl_ms.count == 2
    # The window is only 5 s old: rates divide by the time actually covered.
    assert early.prompt_tokens_per_s == pytest.approx(100 / 5.0)
    assert early.prefill_tokens_per_s == pytest.approx(20 * 200 / 5.0)
    assert early.decode_tokens_per_s == pytest.approx(20 * 4 / 5.0)
    assert early.generation_tokens_per_s == pytest.approx(3 / 5.0)
    assert early.request_rate == pytest.approx(1 / 5.0)
    assert early.preemptions == 10
    assert early.iterations == 20
    assert early.mean_iteration_ms == pytest.approx(40.0)
    assert early.budget_utilisation == pytest.approx(204 / 256)

    window.on_arrival(7, now=14.0)
    _stream(window, "new", arrival=14.0, scheduled=14.1, token_times=[14.2, 14.25], prompt=7)
    clock.t = 15.0
    late = window.snapshot(Tuning(), Ceilings())
    assert late.ttft_ms.count == 1 and late.ttft_ms.p50 == pytest.approx(200.0)
    assert late.itl_ms.count == 1 and late.itl_ms.max == pytest.approx(50.0)
    assert late.prompt_tokens_per_s == pytest.approx(7 / 10.0)
    assert late.iterations == 0 and late.preemptions == 0 and late.mean_iteration_ms is None


def test_live_counts_override_the_last_iteration_and_roundtrip() -> None:
    clock = Clock(50.0)
    window = StatsWindow(window_s=30.0, clock=clock)
    window.on_iteration(_record(start=49.0, prefill=0, decode=8, kv=0.25, waiting=5, running=8))
    stale = window.snapshot(Tuning(token_budget=300), Ceilings())
    assert (stale.num_waiting, stale.num_running, stale.kv_usage) == (5, 8, 0.25)
    live = window.snapshot(Tuning(token_budget=300), Ceilings(), num_waiting=0, num_running=0, kv_usage=0.0)
    assert (live.num_waiting, live.num_running, live.kv_usage) == (0, 0, 0.0)
    again = WindowStats.from_dict(live.to_dict())
    assert again == live and again.tuning.token_budget == 300


def test_idle_iterations_do_not_dilute_budget_utilisation() -> None:
    window = StatsWindow(window_s=30.0, clock=Clock(10.0))
    window.on_iteration(_record(start=1.0, prefill=100, decode=28, budget=128))
    window.on_iteration(_record(start=2.0, prefill=0, decode=0, budget=128))
    assert window.snapshot(Tuning(), Ceilings()).budget_utilisation == pytest.approx(1.0)


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError):
        StatsWindow(window_s=0)
    assert math.isfinite(StatsWindow(1.0).snapshot(Tuning(), Ceilings()).request_rate)


def test_prefill_rate_for_retry_after_is_cached_for_a_second() -> None:
    clock = Clock(0.0)
    window = StatsWindow(window_s=10.0, clock=clock)
    clock.t = 10.0
    window.on_iteration(_record(start=9.0, prefill=500, decode=0))
    assert window.prefill_tokens_per_s() == pytest.approx(500 / 10.0)
    window.on_iteration(_record(start=9.5, prefill=500, decode=0))
    clock.t = 10.5
    assert window.prefill_tokens_per_s() == pytest.approx(50.0)  # cached
    clock.t = 11.5
    assert window.prefill_tokens_per_s() == pytest.approx(1000 / 10.0)
