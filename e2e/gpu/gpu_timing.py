"""Timers for the GPU check: CUDA events, CUDA-graph replay (no launch gaps), wall time of whole iterations.

Each takes the device: on CUDA it times the GPU; where CUDA is absent (the dry run) the same call runs the same
work under a host clock, once, with no warm-up (nothing compiles there), so every section goes through its real
code on the CPU in little time. CPU figures mean nothing.
"""
from __future__ import annotations

import statistics
import time


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_cache(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


def events_ms(fn, warmup: int, reps: int, device) -> list[float]:
    """Milliseconds of each of `reps` calls after `warmup` calls."""
    import torch

    if device.type != "cuda":
        warmup, reps = 0, 1
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def graph_time_ms(calls, device, reps: int = 5) -> float:
    """Capture `calls` (a list of thunks) in one CUDA graph; ms per call, median over replays.
    Without CUDA: the calls run in turn under a host clock."""
    import torch

    if device.type != "cuda":
        return statistics.median(events_ms(lambda: [c() for c in calls], 0, reps, device)) / len(calls)
    for c in calls:  # warm: compile kernels, plan
        c()
    synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    per = events_ms(graph.replay, 1, reps, device)
    return statistics.median(per) / len(calls)


def wall_ms(fn, reps: int, device, warmup: int = 3) -> float:
    """Median wall time of a whole iteration (host preparation, launches, the sampled tokens' read-back)."""
    if device.type != "cuda":
        warmup, reps = 0, 1
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
