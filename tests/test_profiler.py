"""The start-up profile: measured through the real engine, leaves it clean; the budget recipe on top of it."""
from __future__ import annotations

import pytest
import torch

from stallfree.contracts import Ceilings, Profile, ProfilePoint, Tuning, min_budget_for
from stallfree.profile_rules import MIN_TOKEN_BUDGET, SLO_MARGIN
from stallfree.node_daemon.measure.profiler import (ProfileSettings, curve_problems, run_profile,
                                                  starting_tuning, suggest_token_budget, suspect_points)
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.cli.serve import parse_options
from stallfree.node_daemon.daemon import build_llm_engine


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
    profile = run_profile(engine, device, ProfileSettings(repeats=2, max_seconds=60)).profile
    assert profile.device == "cpu"
    assert [p.tokens for p in profile.decode_only] == [1, 2, 4, 8, 16, 32]
    assert all(p.num_decodes == p.tokens and p.iteration_ms > 0 for p in profile.decode_only)
    assert [p.tokens for p in profile.mixed] == [64, 128, 256, 512]
    assert all(p.num_decodes == 4 and p.iteration_ms > 0 for p in profile.mixed)
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
    profile = run_profile(engine, device, ProfileSettings(repeats=1, warmup=0, max_seconds=30)).profile
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
        run_profile(engine, device)


PROFILE = Profile(device="test", mixed=[ProfilePoint(64, 16, 5.0), ProfilePoint(128, 16, 8.0),
                                        ProfilePoint(256, 16, 14.0), ProfilePoint(512, 16, 30.0)])


def test_suggested_budget_is_the_daemons_start() -> None:
    ceilings = Ceilings(max_token_budget=2048, max_num_seqs=256)
    running = Tuning(max_num_seqs=16)
    # A measured point, never one between them, fitting SLO_MARGIN of the target: 0.8 x 20 ms = 16 ms lies between
    # 256 (14) and 512 (30).
    assert suggest_token_budget(PROFILE, 20.0, ceilings, running) == 256
    assert suggest_token_budget(PROFILE, 17.5, ceilings, running) == 256
    assert suggest_token_budget(PROFILE, 37.5, ceilings, running) == 512
    assert suggest_token_budget(PROFILE, 1000.0, Ceilings(max_token_budget=300), running) == 300
    for target in (1.0, 6.0, 15.0, 40.0):
        assert suggest_token_budget(PROFILE, target, ceilings, running) == \
            starting_tuning(PROFILE, target, ceilings, running).token_budget
    with pytest.raises(ValueError):
        suggest_token_budget(Profile(device="x"), 10.0, ceilings, running)


def test_the_starting_budget_is_the_largest_measured_point_within_the_margin() -> None:
    ceilings = Ceilings(max_token_budget=2048, max_num_seqs=256)
    for slo, budget in ((100.0, 512), (1000.0, 512), (18.0, 256), (15.0, 128), (10.0, 128)):
        assert starting_tuning(PROFILE, slo, ceilings, Tuning()).token_budget == budget
        assert PROFILE.iteration_ms_at(budget) <= SLO_MARGIN * slo  # what was measured there fits
    # Never past the largest measured point, however loose the SLO: the ceiling only caps it.
    assert starting_tuning(PROFILE, 1000.0, Ceilings(max_token_budget=300), Tuning()).token_budget == 300


def test_starting_tuning_keeps_a_margin_and_lowers_max_num_seqs_when_tight() -> None:
    ceilings = Ceilings(max_token_budget=2048, max_num_seqs=256)
    roomy = starting_tuning(PROFILE, 15.0, ceilings, Tuning(max_num_seqs=64, max_partial_prefills=2))
    # 0.8 x 15 ms = 12 ms: 128 (8 ms) fits, 256 (14 ms) does not; 64 decodes leave prefill room at 128.
    assert (roomy.token_budget, roomy.max_num_seqs, roomy.max_partial_prefills) == (128, 64, 2)
    # 0.8 x 6 ms is under the smallest point's 5 ms: nothing fits, so the smallest measured budget (the curve is
    # flat below it: a smaller one would be predicted no faster), with max_num_seqs down to leave it prefill room.
    tight = starting_tuning(PROFILE, 6.0, ceilings, Tuning(max_num_seqs=64))
    assert (tight.token_budget, tight.max_num_seqs) == (64, 32) and min_budget_for(32) == 64


def test_time_cap_stops_the_sweep_and_still_cleans_up(one_thread) -> None:
    engine, device, _ = _engine(["--model", "tiny", "--device", "cpu", "--max-token-budget", "512",
                                 "--max-num-seqs-ceiling", "32", "--max-num-seqs", "8", "--token-budget", "128",
                                 "--num-kv-blocks", "512"])
    run = run_profile(engine, device, ProfileSettings(max_seconds=1e-6))
    # One point is always measured (nothing to choose a budget from otherwise), then the budget stops it.
    assert [p.tokens for p in run.profile.mixed] == [64] and run.profile.decode_only == []
    assert "mixed 128 tokens (4 decodes)" in run.skipped
    assert not engine.has_unfinished() and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_the_time_budget_bounds_the_sweep(one_thread) -> None:
    engine, device, _ = _engine(["--model", "tiny", "--device", "cpu", "--max-token-budget", "2048",
                                 "--max-num-seqs-ceiling", "256", "--max-num-seqs", "8", "--token-budget", "128",
                                 "--num-kv-blocks", "4096"])
    lines: list[str] = []
    run = run_profile(engine, device, ProfileSettings(max_seconds=0.3, progress=lines.append))
    # Stopped by the budget (points left unmeasured), past it by about the point in flight (milliseconds for the
    # tiny model; the margin is for a busy machine).
    assert run.skipped and run.seconds < 0.3 + 3.0
    assert run.profile.mixed and lines and all(line.startswith("profile") for line in lines)
    planned = len(run.profile.mixed) + len(run.profile.decode_only) + len(run.skipped)
    assert all(f"/{planned}" in line for line in lines if line.startswith("profile point"))


def test_should_stop_abandons_the_run_and_leaves_the_engine_clean(one_thread) -> None:
    engine, device, _ = _engine(["--model", "tiny", "--device", "cpu", "--max-token-budget", "512",
                                 "--max-num-seqs-ceiling", "32", "--max-num-seqs", "8", "--token-budget", "128",
                                 "--num-kv-blocks", "512"])
    steps = []
    run = run_profile(engine, device, ProfileSettings(max_seconds=30, should_stop=lambda: steps.append(1) or
                                                      len(steps) > 3))
    assert run.stopped and not run.trusted
    assert not engine.has_unfinished() and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def _curve(*ms: float) -> list[ProfilePoint]:
    return [ProfilePoint(64 << i, 4, value) for i, value in enumerate(ms)]


def test_a_curve_that_is_not_monotone_or_jumps_is_suspect() -> None:
    assert curve_problems(_curve(10, 18, 34, 70)) == []
    assert curve_problems(_curve(10, 9.8, 18)) == []  # within the noise tolerance
    problems = curve_problems(_curve(10, 18, 16, 34))  # 256 faster than 128
    assert len(problems) == 1 and problems[0].startswith("not monotone")
    assert suspect_points(_curve(10, 18, 16, 34)) == [128, 256]
    jump = curve_problems(_curve(10, 18, 600, 70))  # the busy point: 8,408 ms against 427 quiet
    assert any(p.startswith("jump") for p in jump) and any(p.startswith("not monotone") for p in jump)


class _SlowOnce:
    """Wraps an executor: the n-th mixed iteration of one size takes `extra_s` longer (another process ran)."""

    def __init__(self, executor, tokens: int, extra_s: float, times: int) -> None:
        self.executor, self.tokens, self.extra_s, self.times = executor, tokens, extra_s, times

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def execute(self, output):
        import time

        if output.num_prefill_tokens + output.num_decode_tokens == self.tokens and self.times > 0:
            self.times -= 1
            time.sleep(self.extra_s)
        return self.executor.execute(output)


def test_a_busy_point_is_measured_again_and_the_fastest_kept(one_thread) -> None:
    engine, device, _ = _engine(["--model", "tiny", "--device", "cpu", "--max-token-budget", "512",
                                 "--max-num-seqs-ceiling", "32", "--max-num-seqs", "8", "--token-budget", "128",
                                 "--num-kv-blocks", "1024"])
    # Both first runs at 256 tokens are slow: keeping the fastest of them is not enough, the repair is.
    engine.executor = _SlowOnce(engine.executor, 256, 1.0, times=2)
    lines: list[str] = []
    run = run_profile(engine, device, ProfileSettings(repeats=2, max_seconds=60, progress=lines.append))
    by_tokens = {p.tokens: p.iteration_ms for p in run.profile.mixed}
    # A slowed run takes over 1 s, a busy machine's plain one a fraction of that: the point kept is not slowed.
    assert by_tokens[256] < 1000.0 and any("re-measured mixed 256" in line for line in lines)


def test_a_busy_curve_that_stays_wrong_is_not_trusted(one_thread) -> None:
    engine, device, _ = _engine(["--model", "tiny", "--device", "cpu", "--max-token-budget", "512",
                                 "--max-num-seqs-ceiling", "32", "--max-num-seqs", "8", "--token-budget", "128",
                                 "--num-kv-blocks", "1024"])
    engine.executor = _SlowOnce(engine.executor, 256, 0.25, times=100)  # busy for the whole run
    run = run_profile(engine, device, ProfileSettings(repeats=2, max_seconds=60))
    assert not run.trusted and any("256 tokens" in w for w in run.warnings)


def test_a_slow_engine_keeps_serving_several_streams_under_a_tight_slo() -> None:
    slow = Profile(device="cpu", mixed=[ProfilePoint(64, 4, 200.0), ProfilePoint(128, 4, 350.0)])
    tuning = starting_tuning(slow, 150.0, Ceilings(), Tuning(max_num_seqs=64))
    assert (tuning.token_budget, tuning.max_num_seqs) == (64, 32)  # the smallest point, with room beside 32
    # A smaller first point still starts at the default floor budget (MIN_TOKEN_BUDGET, the tuner's too).
    tiny = Profile(device="cpu", mixed=[ProfilePoint(16, 4, 200.0), ProfilePoint(64, 4, 350.0)])
    tuning = starting_tuning(tiny, 150.0, Ceilings(), Tuning(max_num_seqs=64))
    assert (tuning.token_budget, tuning.max_num_seqs) == (MIN_TOKEN_BUDGET, 32)
    # A ceiling under that floor takes max_num_seqs lower, but never under MIN_STARTING_SEQS (8).
    tuning = starting_tuning(tiny, 150.0, Ceilings(max_token_budget=36), Tuning(max_num_seqs=64))
    assert tuning.max_num_seqs == 8 and tuning.token_budget == 36
