"""How many CPU threads torch may use: exactly the cores this process is given.

`--threads N` wins; 0 means the cores the process may run on: its CPU affinity (taskset, a cpuset) capped
by the cgroup's CPU quota (a container's `cpu.max`, or cgroup v1's cfs quota), rounded up. Two replicas
pinned to one core each then run one thread each instead of both spinning on both cores.
"""
from __future__ import annotations

import logging
import math
import os

import torch

log = logging.getLogger(__name__)


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota in cores (cgroup v2 cpu.max, else v1 cfs quota/period), None when unlimited or unknown."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_cores(root: str = "/sys/fs/cgroup") -> tuple[int, str]:
    """(cores, where the figure came from)."""
    try:
        cores, source = len(os.sched_getaffinity(0)), "CPU affinity"
    except (AttributeError, OSError):
        cores, source = os.cpu_count() or 1, "cpu count"
    quota = cgroup_cpu_limit(root)
    if quota is not None and math.ceil(quota) < cores:
        cores, source = max(1, math.ceil(quota)), f"cgroup CPU quota {quota:g}"
    return cores, source


def apply_threads(requested: int | None) -> int | None:
    """Set torch's intra-op threads (None: leave torch as it is); returns the count now in force."""
    if requested is None:
        return None
    if requested < 0:
        raise ValueError(f"--threads must be >= 0 (0: the cores this process is given), got {requested}")
    threads, source = (requested, "--threads") if requested else available_cores()
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)  # the engine runs one forward at a time
    except RuntimeError:
        pass  # already fixed once inter-op work ran in this process
    log.info("torch threads: %d (from %s)", threads, source)
    return threads
