"""The control loop's reading of the router's queue: rates from its counters, a restart, an unreadable router."""
from __future__ import annotations

import httpx

from stallfree.operator.control.observe_router import RouterQueueSource, http_queue_reader


def status(arrivals: int, tokens: float, depth: int = 0) -> dict:
    return {"depth": depth, "queued_prompt_tokens": 100.0 * depth, "oldest_wait_ms": 50.0 * depth,
            "arrivals": arrivals, "arrived_prompt_tokens": tokens}


async def test_arrival_rates_come_from_the_counters_over_the_window_and_the_last_interval():
    readings = iter([status(0, 0.0), status(10, 10_000.0), status(30, 40_000.0, depth=4), status(2, 500.0)])

    async def read():
        return next(readings)

    source = RouterQueueSource(read, window_s=30.0)
    assert (await source.observe_queue(0.0)).arrival_prompt_tokens_per_s == 0.0
    await source.observe_queue(10.0)
    q = await source.observe_queue(20.0)
    assert q.arrival_prompt_tokens_per_s == 2000.0  # 40k tokens over 20 s
    assert (q.recent_prompt_tokens, q.recent_requests, q.recent_s) == (30_000.0, 20, 10.0)
    assert q.depth == 4 and q.queued_prompt_tokens == 400.0 and q.oldest_wait_ms == 200.0
    restarted = await source.observe_queue(30.0)  # counters went back: a new router process
    assert restarted.arrival_prompt_tokens_per_s == 0.0 and restarted.recent_requests == 0


async def test_an_unreachable_router_is_no_information():
    async with httpx.AsyncClient() as client:
        read = http_queue_reader(client, "http://127.0.0.1:9", timeout_s=0.5)
        assert await RouterQueueSource(read, 30.0).observe_queue(0.0) is None


def test_the_spread_of_prompt_lengths_comes_from_the_routers_sums():
    from stallfree.operator.control.queueing import prompt_cv2

    lengths = [1000, 3000] * 10  # mean 2000, standard deviation 1000: cv^2 = 0.25
    assert prompt_cv2(len(lengths), sum(lengths), sum(n * n for n in lengths)) == 0.25
    assert prompt_cv2(5, 5000.0, 5e6) is None  # too few to tell


async def test_per_objective_windows_come_from_the_routers_per_objective_counters():
    def reading(arrivals: int, tokens: float, shed: int) -> dict:
        out = status(arrivals, tokens)
        out["objectives"] = {"batch": {"priority": -1, "depth": 3, "shed": shed, "offered": arrivals,
                                       "offered_prompt_tokens": tokens, "completed": arrivals // 2,
                                       "good": arrivals // 4, "p99_ttft_ms": 900.0 + arrivals,
                                       "p99_queue_wait_ms": None},
                             "interactive": {"priority": 0, "depth": 1, "shed": 0}}  # an older router's figures
        return out

    readings = iter([reading(0, 0.0, 5), reading(10, 10_000.0, 7), reading(30, 40_000.0, 12)])

    async def read():
        return next(readings)

    source = RouterQueueSource(read, window_s=30.0)
    for t in (0.0, 10.0):
        await source.observe_queue(t)
    windows = {w.name: w for w in (await source.observe_queue(20.0)).objectives}
    batch = windows["batch"]
    assert batch.sheddable and batch.depth == 3 and batch.shed == 7  # 12 - 5 over the window
    assert batch.arrival_prompt_tokens_per_s == 2000.0 and (batch.recent_prompt_tokens, batch.recent_requests) == (
        30_000.0, 20)
    assert windows["interactive"].arrival_prompt_tokens_per_s is None  # not counted per objective: unknown
    # Answered and good over the window (counters), the p99s as the router's own window gives them now.
    assert (batch.completed, batch.good, batch.goodput) == (15, 7, 7 / 22)
    assert (batch.ttft_p99_ms, batch.queue_wait_p99_ms) == (930.0, None)
    assert windows["interactive"].ttft_p99_ms is None and windows["interactive"].goodput is None


async def test_summed_routers_add_their_objectives_up():
    from stallfree.operator.control.observe_router import summed_reader

    async def one():
        return {**status(10, 1000.0, depth=1), "objectives": {"batch": {"priority": -1, "depth": 2, "shed": 1,
                                                                         "oldest_wait_ms": 10.0,
                                                                         "p99_ttft_ms": 700.0}}}

    async def two():
        return {**status(5, 500.0), "objectives": {"batch": {"priority": -1, "depth": 3, "shed": 4,
                                                              "oldest_wait_ms": 30.0, "p99_ttft_ms": 400.0,
                                                              "p99_queue_wait_ms": 50.0}}}

    async def readers():
        return [one, two]

    total = await summed_reader(readers)()
    assert total["objectives"]["batch"] == {"priority": -1, "depth": 5.0, "shed": 5.0, "oldest_wait_ms": 30.0,
                                            "p99_ttft_ms": 700.0, "p99_queue_wait_ms": 50.0}  # the worst router's
