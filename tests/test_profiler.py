"""The start-up profile: measured through the real engine, leaves it clean; the budget recipe on top of it."""
from __future__ import annotations

import pytest
import torch

from stallfree.contracts import Ceilings, Profile, ProfilePoint, Tuning, min_budget_for
from stallfree.node_daemon.engine.profiler import ProfileSettings, measure_profile, starting_tuning, suggest_token_budget
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.cli.serve import build_llm_engine, parse_options


class CountingObserver:
    def __init__(self) -> None:
        self.calls = 0

    def on_iteration(self, record) -> None:
        self.calls += 1

    def on_token(self, request, now, first) -> None:
        self.calls += 1

    def on_finished(self, request, now) -> None:
        self.calls += 1


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _engine(args: list[str]):
    opts = parse_options(args)
    observer = CountingObserver()
    engine, device = build_llm_engine(opts, observer)
    return engine, device, observer


def test_profile_of_the_tiny_model_through_the_engine(one_thread) -> None:
    engine, device, observer = _engine(["--model", "tiny", "--device", "cpu", "--max-token-budget", "512",
                                        "--max-num-seqs-ceiling", "32", "--max-num-seqs", "8", "--token-budget", "128",
                                        "--num-kv-blocks", "1024"])
    tuning = engine.get_tuning()
    profile = measure_profile(engine, device, ProfileSettings(repeats=2, max_seconds=30))
    assert profile.device == "cpu"
    assert [p.tokens for p in profile.decode_only] == [1, 2, 4, 8, 16, 32]
    assert all(p.num_decodes == p.tokens and p.iteration_ms > 0 for p in profile.decode_only)
    assert [p.tokens for p in profile.mixed] == [64, 128, 256, 512]
    assert all(p.num_decodes == 16 and p.iteration_ms > 0 for p in profile.mixed)
    # The engine serves afterwards exactly as before: empty, every block free, its tuning and observer back.
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.get_tuning() == tuning
    assert observer.calls == 0 and engine.observer is observer
    engine.add_request("after", prompt_token_ids=[20, 21, 22], sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert observer.calls > 0
    assert Profile.from_dict(profile.to_dict()) == profile


def test_sim_profile_follows_the_cost_model() -> None:
    engine, device, _ = _engine(["--backend", "sim", "--model", "llama-3-8b", "--hardware", "a100",
                                 "--max-token-budget", "1024", "--max-num-seqs-ceiling", "16", "--max-num-seqs", "8",
                                 "--token-budget", "256"])
    profile = measure_profile(engine, device, ProfileSettings(repeats=1, warmup=0, max_seconds=30))
    assert device == "sim:a100"
    assert [p.tokens for p in profile.mixed] == [64, 128, 256, 512, 1024]
    cost = engine.executor.cost_model
    for point in profile.mixed:
        # The sim sleeps the predicted time: a measured iteration cannot be shorter than the roofline says.
        floor = cost.predict_ms([64] * point.num_decodes, [(0, point.tokens - point.num_decodes)])
        assert point.iteration_ms >= 0.95 * floor
    assert profile.mixed[-1].iteration_ms > profile.mixed[0].iteration_ms


def test_profile_refuses_a_busy_engine(one_thread) -> None:
    engine, device, _ = _engine(["--model", "tiny", "--device", "cpu", "--max-token-budget", "256",
                                 "--max-num-seqs-ceiling", "8", "--max-num-seqs", "8", "--token-budget", "128",
                                 "--num-kv-blocks", "256"])
    engine.add_request("busy", prompt_token_ids=[30, 31], sampling=SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="idle"):
        measure_profile(engine, device)


PROFILE = Profile(device="test", mixed=[ProfilePoint(64, 16, 5.0), ProfilePoint(128, 16, 8.0),
                                        ProfilePoint(256, 16, 14.0), ProfilePoint(512, 16, 30.0)])


def test_suggested_budget_is_the_largest_that_fits() -> None:
    ceilings = Ceilings(max_token_budget=2048, max_num_seqs=256)
    assert suggest_token_budget(PROFILE, 15.0, ceilings, max_num_seqs=16) == 256
    assert suggest_token_budget(PROFILE, 30.0, ceilings, max_num_seqs=16) == 512
    assert suggest_token_budget(PROFILE, 1000.0, Ceilings(max_token_budget=300), max_num_seqs=16) == 300
    # Nothing fits: never below the prefill floor of max_num_seqs.
    assert suggest_token_budget(PROFILE, 1.0, ceilings, max_num_seqs=64) == min_budget_for(64)
    with pytest.raises(ValueError):
        suggest_token_budget(Profile(device="x"), 10.0, ceilings, 8)


def test_starting_tuning_lowers_max_num_seqs_when_the_slo_is_tight() -> None:
    ceilings = Ceilings(max_token_budget=2048, max_num_seqs=256)
    roomy = starting_tuning(PROFILE, 15.0, ceilings, Tuning(max_num_seqs=64, max_partial_prefills=2))
    assert (roomy.token_budget, roomy.max_num_seqs, roomy.max_partial_prefills) == (256, 64, 2)
    tight = starting_tuning(PROFILE, 6.0, ceilings, Tuning(max_num_seqs=64))
    assert tight.token_budget == 64 and tight.max_num_seqs == 32  # 32 decodes + 32 tokens of prefill room
    assert min_budget_for(tight.max_num_seqs) <= tight.token_budget


def test_time_cap_stops_the_sweep_and_still_cleans_up(one_thread) -> None:
    engine, device, _ = _engine(["--model", "tiny", "--device", "cpu", "--max-token-budget", "512",
                                 "--max-num-seqs-ceiling", "32", "--max-num-seqs", "8", "--token-budget", "128",
                                 "--num-kv-blocks", "512"])
    profile = measure_profile(engine, device, ProfileSettings(max_seconds=1e-6))
    assert profile.mixed == [] and profile.decode_only == []
    assert not engine.has_unfinished() and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
