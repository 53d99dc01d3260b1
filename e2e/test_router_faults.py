"""Faults through the router: kills and a SIGSTOP freeze lose nothing, fail only streams on a killed replica and a
request the router would not retry because its replica stopped answering right after it arrived."""
from __future__ import annotations

import asyncio

import pytest

from stallfree.bench.router_faults import FaultConfig, FaultRun

pytestmark = pytest.mark.slow


def test_kills_and_a_freeze_through_the_router(tmp_path):
    config = FaultConfig(duration_s=15.0, rate=10.0, freeze_s=5.0, seed=3)
    result = asyncio.run(FaultRun(config, tmp_path).run())
    print(result)
    assert result["lost"] == 0
    assert result["failed_unexplained"] == 0, result["failure_reasons"]
    assert result["completed"] + result["cancelled"] + result["failed"] == result["requests"]
    assert result["leaked_kv_replicas"] == 0, result["kv_after"]
    assert [f["kind"] for f in result["faults"]].count("kill") == 3
    for fault in result["faults"]:
        assert fault["detected_after_s"] is not None and fault["detected_after_s"] < 2.0, fault
        assert fault["back_after_s"] is not None, fault  # taken back once it answers again
