"""Start-up times as the router learns them (startup_times.py, ReplicaPool): what shedding counts a starting
replica by."""
from __future__ import annotations

import pytest

from stallfree.operator.router.replicas import Replica, ReplicaPool
from stallfree.operator.router.startup_times import StartupTimes


def test_the_expected_start_up_is_the_median_of_the_last_seen_or_the_default():
    times = StartupTimes(default_s=60.0, keep=3)
    assert times.expected_s() == 60.0
    for seconds in (100.0, 20.0, 30.0, 40.0):  # the first falls out of the last three
        times.observed(seconds)
    assert times.expected_s() == 30.0
    assert times.ready_in_ms(10.0) == 20_000.0
    assert times.ready_in_ms(45.0) == 0.0  # overdue: any moment now
    assert times.ready_in_ms(61.0) is None  # twice the expected and more: not counted (it may never come)
    with pytest.raises(ValueError, match="positive"):
        StartupTimes(default_s=0.0)


def test_the_pool_learns_a_start_up_only_from_a_replica_it_saw_loading():
    pool = ReplicaPool(admin_token=None)
    loading = Replica("new", "http://x", seen_at=100.0)
    up = Replica("old", "http://y", seen_at=100.0)
    pool.replicas = {"new": loading, "old": up}
    loading.mark(False, "loading model")
    pool._track_startup(loading, 101.0)
    assert loading.starting and not up.healthy and up.starting  # "not polled yet" counts as starting too
    assert pool.starting_in_ms(110.0) == [50_000.0, 50_000.0]
    up.mark(True, "ready")
    pool._track_startup(up, 100.5)  # ready at its first poll: it was up already, no start-up learnt
    loading.mark(True, "ready")
    pool._track_startup(loading, 140.0)
    assert pool.startup_times.expected_s() == 40.0 and pool.starting_in_ms(150.0) == []
    loading.mark(False, "loading model")  # a restart later is no scale-out start-up: not counted as starting
    assert not loading.starting
