"""Soak: thousands of requests with random cancellations across two daemon processes, one of them killed.

Afterwards every request has an explicit outcome (completed, cancelled by its client, or failed on the
replica that was killed), no KV block is still held anywhere, and the survivor's memory is flat.
`stallfree bench soak` prints the same figures for longer runs.
"""
from __future__ import annotations

import asyncio

import pytest

from stallfree.bench.soak import Soak, SoakConfig

pytestmark = pytest.mark.slow


def test_soak_loses_nothing_leaks_no_kv_and_keeps_memory_flat(tmp_path):
    config = SoakConfig(requests=3000, concurrency=64, replicas=2, cancel_fraction=0.2, kill_at_fraction=0.4, seed=7)
    result = asyncio.run(Soak(config, tmp_path).run())
    print(result)

    assert result["lost"] == 0
    assert result["failed"] == 0, result["failure_reasons"]  # no failure anywhere but on the killed replica
    assert result["completed"] + result["cancelled"] + result["failed_on_killed_replica"] == config.requests
    assert result["cancelled"] > 0.1 * config.requests
    # Only requests in flight on the killed replica (or routed to it before its death was seen) may fail.
    assert 0 < result["failed_on_killed_replica"] <= config.concurrency
    assert result["kills"] == 1 and result["restarts"] == 1
    assert result["leaked_kv_replicas"] == 0, result["kv_after"]
    memory = result["survivor_rss_mb"]
    assert memory["end"] - memory["at_50pct"] < 10.0, memory
