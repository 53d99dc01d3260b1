"""Virtual-time simulation: VirtualReplica, the simulator, the long-prompt scenario, capacity, sweeps."""
from __future__ import annotations

import pytest

from stallfree.contracts import Ceilings, Profile, TuningError, Tuning
from stallfree.node_daemon.config import SchedulerConfig
from stallfree.node_daemon.sim.backend import build_cost_model
from stallfree.node_daemon.sim.virtual_replica import VirtualReplica


@pytest.fixture
def cost():
    return build_cost_model("llama-3-8b", "h100")


def _replica(cost, budget=512, max_num_seqs=64, **kwargs) -> VirtualReplica:
    config = SchedulerConfig(ceilings=Ceilings(4096, 256), tuning=Tuning(budget, max_num_seqs), max_model_len=8192)
    return VirtualReplica(cost, config, num_kv_blocks=20_000, **kwargs)


# ---- VirtualReplica ---------------------------------------------------------------------------


def test_a_lone_request_takes_exactly_the_cost_models_time(cost):
    replica = _replica(cost, budget=2048, keep_records=True)
    replica.submit(1000, 5, arrival_time=2.0)
    replica.advance_to(1.0)
    assert replica.num_iterations == 0 and replica.now == 1.0  # nothing has arrived yet
    replica.run_until_idle()
    (record,) = replica.finished
    assert record.queue_wait_s == 0.0
    assert record.ttft_s == pytest.approx(cost.predict_ms([], [(0, 1000)]) / 1000)
    gaps = [cost.predict_ms([1000 + k], []) / 1000 for k in range(1, 5)]
    assert record.itl_s == pytest.approx(gaps)
    assert record.tpot_s == pytest.approx(sum(gaps) / 4)
    assert record.num_output_tokens == 5


def test_chunked_prompt_takes_ceil_prompt_over_budget_iterations(cost):
    replica = _replica(cost, budget=256, keep_records=True)
    replica.submit(1000, 1)
    replica.run_until_idle()
    chunks = [(0, 256), (256, 256), (512, 256), (768, 232)]
    assert replica.num_iterations == 4
    assert replica.finished[0].ttft_s == pytest.approx(sum(cost.predict_ms([], [c]) for c in chunks) / 1000)


def test_window_stats_report_the_windows_samples(cost):
    replica = _replica(cost, stats_window_s=(5.0, 60.0))
    for i in range(40):
        replica.submit(500, 50, arrival_time=0.25 * i)
    replica.advance_to(20.0)
    long = replica.window_stats(window_s=60.0)
    assert long.ttft_ms.count == 40 and long.tpot_ms.count == 40
    assert long.itl_ms.count == 40 * 49
    assert long.prompt_tokens_per_s == pytest.approx(40 * 500 / 20.0)
    assert long.tpot_ms.p99 < 20 and long.queue_wait_ms.max < long.ttft_ms.max
    assert long.tuning == Tuning(512, 64) and long.ceilings == Ceilings(4096, 256)
    short = replica.window_stats(window_s=5.0)
    assert short.ttft_ms.count == 0 and short.num_running == 0  # everything finished well before t=15
    with pytest.raises(ValueError, match="keeps stats windows"):
        replica.window_stats(window_s=7.0)


def test_set_tuning_is_validated_and_changes_the_next_iterations(cost):
    replica = _replica(cost, budget=128, keep_records=True)
    with pytest.raises(TuningError, match="exceeds its ceiling"):
        replica.set_tuning(Tuning(8192, 64))
    with pytest.raises(TuningError, match="no prefill room"):
        replica.set_tuning(Tuning(70, 64))
    replica.submit(2000, 1)
    replica.advance_to(0.02)  # a few 128-token chunks
    done_before = replica.num_iterations
    replica.set_tuning(Tuning(2048, 64))
    replica.run_until_idle()
    assert replica.tuning.token_budget == 2048
    assert replica.num_iterations == done_before + 1  # the rest of the prompt in one iteration
    assert replica.window_stats().tuning.token_budget == 2048


def test_profile_is_the_cost_models_curve(cost):
    replica = _replica(cost)
    profile = Profile.from_dict(replica.profile().to_dict())
    assert profile.mixed[-1].tokens == 4096  # up to the budget ceiling
    point = profile.mixed[7]
    decodes = [1024] * point.num_decodes
    assert point.iteration_ms == pytest.approx(cost.predict_ms(decodes, [(1024, point.tokens - point.num_decodes)]))
    assert profile.budget_for(30.0) > profile.budget_for(15.0)


def test_for_model_sizes_the_kv_cache_and_refuses_requests_that_cannot_fit():
    replica = VirtualReplica.for_model("mistral-7b", "a100", max_model_len=4096)
    # (0.9 x 80 GiB - 14.5 GB of weights) / (16 tokens x 128 KiB): about 29k blocks.
    assert 25_000 < replica.kv_cache.num_blocks < 32_000
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        replica.submit(4000, 200)
    with pytest.raises(ValueError, match="does not fit"):
        VirtualReplica.for_model("llama-3-70b", "a100")


def test_abort_frees_a_running_request(cost):
    replica = _replica(cost)
    rid = replica.submit(300, 1000)
    replica.advance_to(0.1)
    assert replica.num_running == 1 and replica.kv_usage > 0
    assert replica.abort(rid)
    assert replica.num_running == 0 and replica.kv_usage == 0
    assert not replica.abort(rid)
