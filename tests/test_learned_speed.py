"""Each replica's speed learned from its windows: the profile is a prior, the windows are the truth."""
from __future__ import annotations

from stallfree.contracts import Ceilings, Percentiles, Profile, ProfilePoint, Tuning, WindowStats
from stallfree.operator.control.capacity import prefill_capacity_tokens_per_s
from stallfree.operator.control.learned_speed import LearnedSpeed

PROFILE = Profile("test", decode_only=[ProfilePoint(1, 1, 10.0), ProfilePoint(64, 64, 20.0)],
                  mixed=[ProfilePoint(64, 8, 20.0), ProfilePoint(512, 8, 60.0)])


def window(mean_iteration_ms: float, utilisation: float, prefill: float = 5000.0, decode: float = 500.0) -> WindowStats:
    empty = Percentiles()
    return WindowStats(window_s=30.0, ttft_ms=empty, tpot_ms=empty, itl_ms=empty, queue_wait_ms=empty,
                       request_rate=1.0, prompt_tokens_per_s=prefill, generation_tokens_per_s=decode,
                       prefill_tokens_per_s=prefill, decode_tokens_per_s=decode, budget_utilisation=utilisation,
                       kv_usage=0.1, preemptions=0, num_waiting=0, num_running=8, tuning=Tuning(512, 32),
                       ceilings=Ceilings(), iterations=100, mean_iteration_ms=mean_iteration_ms)


def test_a_replica_faster_than_its_profile_is_counted_at_its_speed_once_its_load_drops():
    busy = window(mean_iteration_ms=60.0 / 1.4, utilisation=1.0)  # x1.4 the profile's speed at full budget
    speed = LearnedSpeed().updated(busy, PROFILE)
    assert abs(speed.mixed - 1 / 1.4) < 1e-9
    light = window(mean_iteration_ms=15.0, utilisation=0.2)  # a window that cannot tell
    assert speed.updated(light, PROFILE) == speed  # what was learned stays
    nominal = prefill_capacity_tokens_per_s(light, PROFILE)
    learned = prefill_capacity_tokens_per_s(light, speed.apply(PROFILE))
    assert abs(learned / nominal - 1.4) < 1e-6  # the profile alone under-counts it by the same 1.4


def test_a_slowdown_moves_the_learned_speed_halfway_each_window():
    speed = LearnedSpeed(mixed=1.0)
    slow = window(mean_iteration_ms=60.0 / 0.6, utilisation=1.0)
    once, twice = speed.updated(slow, PROFILE), speed.updated(slow, PROFILE).updated(slow, PROFILE)
    assert abs(once.mixed - (0.5 + 0.5 / 0.6)) < 1e-9
    assert abs(twice.mixed - 1 / 0.6) < abs(once.mixed - 1 / 0.6)
    assert LearnedSpeed.from_dict(twice.to_dict()) == twice  # survives the status round-trip
