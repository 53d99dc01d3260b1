"""Threads: --threads wins; otherwise the cores given, the cgroup quota capping the affinity."""
from __future__ import annotations

import os

import pytest
import torch

from stallfree.kernels import cpu_threads


def test_cgroup_v2_quota_is_read_and_max_means_unlimited(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_threads.cgroup_cpu_limit(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_threads.cgroup_cpu_limit(str(tmp_path)) is None
    assert cpu_threads.cgroup_cpu_limit(str(tmp_path / "absent")) is None


def test_quota_caps_the_affinity(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert cpu_threads.available_cores(str(tmp_path)) == (1, "cgroup CPU quota 1")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_threads.available_cores(str(tmp_path)) == (4, "CPU affinity")


def test_apply_threads_sets_torch_and_refuses_negative():
    before = torch.get_num_threads()
    try:
        assert cpu_threads.apply_threads(1) == 1 and torch.get_num_threads() == 1
        assert cpu_threads.apply_threads(None) is None and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="--threads must be >= 0"):
            cpu_threads.apply_threads(-2)
    finally:
        torch.set_num_threads(before)
