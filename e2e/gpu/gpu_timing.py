"""Timers for the GPU check: CUDA events, CUDA-graph replay (no launch gaps), wall time of whole iterations."""
from __future__ import annotations

import statistics
import time


def cuda_events_ms(fn, warmup: int, reps: int) -> list[float]:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def graph_time_ms(calls, reps: int = 5):
    """Capture `calls` (a list of thunks) in one CUDA graph; ms per call, median over replays."""
    import torch

    for c in calls:  # warm: compile kernels, plan
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    per = cuda_events_ms(graph.replay, 1, reps)
    return statistics.median(per) / len(calls)


def wall_ms(fn, reps: int) -> float:
    """Median wall time of a whole iteration (host preparation, launches, the sampled tokens' read-back)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
