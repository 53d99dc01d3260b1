"""The router's pure parts: TTFT prediction, the policies, prefix affinity, rates, requests, discovery."""
from __future__ import annotations

import random

import pytest

from stallfree.contracts import Ceilings, Percentiles, Profile, ProfilePoint, Tuning, WindowStats
from stallfree.operator.router.affinity import PrefixTable, prefix_hashes
from stallfree.operator.router.discovery import replicas_from_slices
from stallfree.operator.router.pick import (AffinityMargin, ReplicaView, pick, predict_ttft_ms, rendezvous_home)
from stallfree.operator.router.rates import decode_step_ms, prefill_tokens_per_ms
from stallfree.operator.router.requests import read_request


def view(name, queued=0, rate=10.0, step=10.0, outstanding=0, cached=0, home=False) -> ReplicaView:
    return ReplicaView(name, queued, rate, step, outstanding, cached, home)


def test_prediction_is_queue_plus_prompt_over_rate_plus_step():
    assert predict_ttft_ms(view("a", queued=1000, rate=10.0, step=5.0), 500) == pytest.approx(155.0)
    # Cached leading tokens need no prefill.
    assert predict_ttft_ms(view("a", queued=1000, rate=10.0, step=5.0, cached=400), 500) == pytest.approx(115.0)


def test_slo_aware_prefers_the_fast_replica_over_the_short_queue():
    slow_idle = view("slow", queued=0, rate=2.0)
    fast_busy = view("fast", queued=3000, rate=20.0, outstanding=5)
    choice = pick("slo-aware", [slow_idle, fast_busy], 2000, counter=0)
    assert choice.name == "fast"  # 5000/20 + 10 = 260 ms against 2000/2 + 10 = 1010 ms
    assert choice.predicted_ttft_ms == pytest.approx(260.0)
    # least-outstanding only counts requests: it picks the idle slow one.
    assert pick("least-outstanding", [slow_idle, fast_busy], 2000, counter=0).name == "slow"


def test_a_long_queue_sends_a_request_elsewhere():
    replicas = [view("a", queued=8000), view("b", queued=100), view("c", queued=4000)]
    assert pick("slo-aware", replicas, 300, counter=0).name == "b"


def test_affinity_wins_within_the_margin_and_loses_beyond_it():
    margin = AffinityMargin(absolute_ms=50.0, relative=0.25)
    best = view("best", queued=0)
    warm_close = view("warm", queued=2200, cached=2000)  # 240 ms against the best's 220 ms: within 50 ms
    choice = pick("slo-aware", [best, warm_close], 2100, counter=0, margin=margin)
    assert (choice.name, choice.reason) == ("warm", "affinity")
    warm_far = view("warm", queued=20000, cached=2000)  # 2 s of queue: cache warmth does not pay for it
    choice = pick("slo-aware", [best, warm_far], 2100, counter=0, margin=margin)
    assert (choice.name, choice.reason) == ("best", "fastest")


def test_home_breaks_ties_for_a_prefix_never_seen():
    replicas = [view("a"), view("b", home=True), view("c")]
    assert pick("slo-aware", replicas, 100, counter=0).name == "b"
    # ...but not when the home is much slower.
    replicas = [view("a"), view("b", queued=50_000, home=True), view("c")]
    assert pick("slo-aware", replicas, 100, counter=0).name in ("a", "c")


def test_round_robin_cycles_in_name_order_and_random_is_seeded():
    replicas = [view("b"), view("a"), view("c")]
    assert [pick("round-robin", replicas, 1, counter=i).name for i in range(4)] == ["a", "b", "c", "a"]
    names = [pick("random", replicas, 1, counter=0, rng=random.Random(3)).name for _ in range(1)]
    assert names == [pick("random", replicas, 1, counter=0, rng=random.Random(3)).name]
    with pytest.raises(ValueError, match="unknown routing policy"):
        pick("fastest", replicas, 1, counter=0)
    with pytest.raises(ValueError, match="no replica"):
        pick("slo-aware", [], 1, counter=0)


def test_rendezvous_home_moves_only_keys_of_the_replica_that_left():
    names = ["r0", "r1", "r2", "r3"]
    homes = {k: rendezvous_home(k, names) for k in range(400)}
    assert set(homes.values()) == set(names)
    after = {k: rendezvous_home(k, ["r0", "r1", "r3"]) for k in range(400)}
    assert all(after[k] == homes[k] for k in homes if homes[k] != "r2")


def test_prefix_hashes_chain_full_blocks_only():
    a = prefix_hashes("x" * 100 + "A" * 50, 50)
    b = prefix_hashes("x" * 100 + "B" * 50 + "tail", 50)
    assert len(a) == 3 and len(b) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert prefix_hashes("short", 50) == []


def test_prefix_table_counts_the_leading_run_and_evicts_least_recent():
    table = PrefixTable(block_tokens=10)
    table.set_capacity("r", 40)  # 4 blocks
    p1, p2 = prefix_hashes("a" * 40, 10), prefix_hashes("b" * 40, 10)
    table.record("r", p1, 40)
    assert table.cached_tokens("r", p1) == 40
    assert table.cached_tokens("r", prefix_hashes("a" * 20 + "c" * 20, 10)) == 20
    assert table.cached_tokens("other", p1) == 0
    table.record("r", p2, 40)  # the cache holds 4 blocks: p1 is gone
    assert table.cached_tokens("r", p2) == 40 and table.cached_tokens("r", p1) == 0
    table.forget("r")
    assert table.cached_tokens("r", p2) == 0


def _stats(budget=512, running=16, queued=0, mean_iteration_ms=None) -> WindowStats:
    empty = Percentiles()
    return WindowStats(30.0, empty, empty, empty, empty, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, running,
                       Tuning(token_budget=budget), Ceilings(), mean_iteration_ms=mean_iteration_ms,
                       queued_prompt_tokens=queued)


PROFILE = Profile("sim", decode_only=[ProfilePoint(1, 1, 10.0), ProfilePoint(64, 64, 12.0)],
                  mixed=[ProfilePoint(256, 16, 50.0), ProfilePoint(1024, 16, 200.0)])


def test_rates_from_the_profile_at_the_live_budget():
    assert prefill_tokens_per_ms(PROFILE, _stats(budget=512, running=16)) == pytest.approx((512 - 16) / 100.0)
    assert prefill_tokens_per_ms(PROFILE, _stats(budget=1024, running=24)) == pytest.approx(1000 / 200.0)
    assert decode_step_ms(PROFILE, _stats(running=1)) == pytest.approx(10.0)
    assert decode_step_ms(PROFILE, _stats(running=64)) == pytest.approx(12.0)
    assert 10.0 < decode_step_ms(PROFILE, _stats(running=32)) < 12.0
    # No profile: the measured iteration stands in.
    assert prefill_tokens_per_ms(None, _stats(budget=512, running=12, mean_iteration_ms=50.0)) == pytest.approx(10.0)
    assert decode_step_ms(None, _stats(mean_iteration_ms=33.0)) == 33.0


def test_read_request_finds_stream_and_prompt_text():
    info = read_request(b'{"prompt": "hello world!", "stream": true}', chars_per_token=4.0)
    assert info.stream and info.prompt_text == "hello world!" and info.prompt_tokens == 3
    info = read_request(b'{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", '
                        b'"content": [{"type": "text", "text": "hi"}]}]}', chars_per_token=1.0)
    assert not info.stream and info.prompt_text.startswith("be brief") and "hi" in info.prompt_text
    assert read_request(b'{"prompt": [1, 2, 3]}', 4.0).prompt_tokens == 3
    assert read_request(b"not json", 4.0).prompt_tokens == 0  # forwarded anyway: the replica answers 400


def test_replicas_from_endpoint_slices_skip_terminating_and_name_by_pod():
    slices = [{"ports": [{"name": "metrics", "port": 9}, {"name": "http", "port": 8000}],
               "endpoints": [
                   {"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "targetRef": {"name": "svc-a"}},
                   {"addresses": ["10.0.0.2"], "conditions": {"ready": False}, "targetRef": {"name": "svc-b"}},
                   {"addresses": ["10.0.0.3"], "conditions": {"terminating": True}, "targetRef": {"name": "svc-c"}},
                   {"addresses": ["fd00::4"], "conditions": {}}]}]
    assert replicas_from_slices(slices) == {"svc-a": "http://10.0.0.1:8000", "svc-b": "http://10.0.0.2:8000",
                                            "fd00::4": "http://[fd00::4]:8000"}
