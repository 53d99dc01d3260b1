"""Virtual-time simulation: VirtualReplica, the simulator, the long-prompt scenario, capacity, sweeps."""
from __future__ import annotations

import pytest

from stallfree.contracts import Ceilings, Profile, TuningError, Tuning
from stallfree.node_daemon.engine.config import SchedulerConfig
from stallfree.node_daemon.sim.backend import build_cost_model
from stallfree.simulator.virtual_replica import VirtualReplica
from stallfree.profile_rules import budget_for_tpot


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
    assert budget_for_tpot(profile, 30.0, lo=1, margin=1.0) > budget_for_tpot(profile, 15.0, lo=1, margin=1.0)


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


# ---- the long-prompt scenario -------------------------------------------------------------------

from stallfree.simulator.scenarios import long_prompt_scenario  # noqa: E402
from stallfree.simulator.simulate import SimSetup, simulate  # noqa: E402

# A small model on the textbook device: every figure below follows from the cost model's arithmetic.
SMALL = SimSetup(model="qwen2-0.5b", hardware="textbook", max_model_len=8192, max_num_seqs=32, num_kv_blocks=4096)


def test_without_chunking_the_prompt_stalls_every_decode_for_its_whole_prefill():
    result = long_prompt_scenario(SMALL, decoders=16, prompt_len=4096, decoder_prompt_len=256,
                                  decoder_output_len=512, no_chunking=True)
    cost = SMALL.build_replica().cost_model
    assert result["prefill_iterations"] == 1
    assert result["decode_tokens_during_prefill"] == 0
    assert result["ttft_ms"] == pytest.approx(cost.predict_ms([], [(0, 4096)]))
    # The gap spans the prefill plus the next decode step.
    assert result["ttft_ms"] < result["max_decode_gap_ms"] < result["ttft_ms"] + 3 * result["steady_decode_gap_ms"]


def test_a_token_budget_bounds_the_decode_gap_at_some_cost_in_ttft():
    stalled = long_prompt_scenario(SMALL, 16, 4096, 256, 512, no_chunking=True)
    budget = 16 + 256
    chunked = long_prompt_scenario(SMALL.__class__(**{**SMALL.__dict__, "token_budget": budget}), 16, 4096, 256, 512)
    assert chunked["prefill_iterations"] == 4096 // 256
    assert chunked["decode_tokens_during_prefill"] == 16 * chunked["prefill_iterations"]
    assert chunked["max_decode_gap_ms"] * 5 < stalled["max_decode_gap_ms"]
    assert chunked["ttft_ms"] > stalled["ttft_ms"]  # re-reads and per-iteration weight reads


def test_an_iteration_time_target_keeps_every_gap_under_it():
    setup = SimSetup(**{**SMALL.__dict__, "policy": "stall-free-time", "iteration_time_target_ms": 4.0})
    result = long_prompt_scenario(setup, 16, 4096, 256, 512)
    assert result["max_decode_gap_ms"] <= 4.0 + 1e-9
    assert result["prefill_iterations"] > 1


def test_scenario_refuses_what_cannot_fit():
    with pytest.raises(ValueError, match="does not fit max_model_len"):
        long_prompt_scenario(SMALL, 4, 9000)
    with pytest.raises(ValueError, match="tokens of KV cache"):
        long_prompt_scenario(SimSetup(model="llama-3-8b", hardware="a100"), 400, 4096, 1024, 4096)


# ---- workloads, capacity, sweeps ----------------------------------------------------------------

from stallfree.simulator.capacity import CapacityCriteria, find_capacity  # noqa: E402
from stallfree.simulator.latency_summary import SLOs  # noqa: E402
from stallfree.simulator.sweep import budget_sweep  # noqa: E402
from stallfree.simulator.workload import Fixed, WorkloadSpec, generate, parse_length  # noqa: E402

MISTRAL_A100 = SimSetup(model="mistral-7b", hardware="a100", token_budget=512, max_num_seqs=64, num_kv_blocks=16384)
SMALL_MIX = WorkloadSpec(num_requests=120, prompt=parse_length("mix:0.8*fixed:256|0.2*fixed:3000"),
                         output=Fixed(48), seed=3)


def test_simulation_reports_every_request_and_goodput_under_slos():
    requests = generate(WorkloadSpec(rate=4.0, num_requests=60, prompt=Fixed(512), output=Fixed(32), seed=1))
    result = simulate(requests, MISTRAL_A100, SLOs(ttft_ms=200, tpot_ms=30))
    s = result.summary
    assert s["completed"] == 60 and len(result.requests) == 60
    assert s["itl_ms"]["count"] == 60 * 31 == len(result.itl_ms)
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= s["ttft_ms"]["max"]
    assert s["goodput"] == pytest.approx(sum(r["slo_met"] for r in result.requests) / s["duration_s"])
    assert all(r["queue_wait_ms"] <= r["ttft_ms"] <= r["e2e_ms"] for r in result.requests)


def test_chunking_keeps_tail_itl_low_where_prefill_priority_stalls():
    requests = generate(WorkloadSpec(rate=3.0, num_requests=80, prompt=parse_length("mix:0.7*fixed:200|0.3*fixed:4000"),
                                     output=Fixed(64), seed=2))
    stall_free = simulate(requests, MISTRAL_A100).summary
    prefill_first = simulate(requests, SimSetup(**{**MISTRAL_A100.__dict__, "policy": "prefill-priority"})).summary
    decode_first = simulate(requests, SimSetup(**{**MISTRAL_A100.__dict__, "policy": "decode-priority"})).summary
    assert stall_free["itl_ms"]["max"] * 3 < prefill_first["itl_ms"]["max"]
    # Decode-priority never stalls a decode but starves prompts: queue wait balloons.
    assert decode_first["queue_wait_ms"]["p99"] > stall_free["queue_wait_ms"]["p99"]
    assert all(s["completed"] == 80 for s in (stall_free, prefill_first, decode_first))


def test_capacity_search_brackets_the_highest_passing_rate():
    criteria = CapacityCriteria(tbt_slo_ms=60.0)
    stall_free = find_capacity(SMALL_MIX, MISTRAL_A100, criteria, rel_tol=0.05)
    prefill_first = find_capacity(SMALL_MIX, SimSetup(**{**MISTRAL_A100.__dict__, "policy": "prefill-priority"}),
                                  criteria, rel_tol=0.05)
    for result in (stall_free, prefill_first):
        passed = [p.rate for p in result.probes if p.ok]
        failed = [p.rate for p in result.probes if not p.ok]
        assert result.capacity_rps == max(passed)
        assert min(r for r in failed if r > result.capacity_rps) <= result.capacity_rps * 1.06
    assert stall_free.capacity_rps > 1.5 * prefill_first.capacity_rps


def test_budget_sweep_traces_the_ttft_tpot_tradeoff_and_the_profile_pick():
    workload = WorkloadSpec(rate=2.0, num_requests=60, prompt=Fixed(2000), output=Fixed(32), seed=4)
    result = budget_sweep(workload, MISTRAL_A100, [128, 512, 2048], SLOs(tpot_ms=40), target_fraction=0.8)
    tpot = [p.tpot_p99_ms for p in result.points]
    ttft = [p.ttft_p99_ms for p in result.points]
    assert tpot[0] < tpot[1] < tpot[2]
    assert ttft[0] > ttft[1] > ttft[2]
    profile = SimSetup(**{**MISTRAL_A100.__dict__, "token_budget": 2048, "max_token_budget": 2048}).build_replica().profile()
    assert result.profile_budget == budget_for_tpot(profile, 32.0, lo=128, hi=2048, margin=1.0)
    assert 128 < result.profile_budget < 2048
    with pytest.raises(ValueError, match="TPOT SLO"):
        budget_sweep(workload, MISTRAL_A100, [128], SLOs())


# ---- the command ------------------------------------------------------------------------------

from stallfree.cli import simulate as simulate_cli  # noqa: E402


def test_cli_scenario_json_has_the_figures(tmp_path, capsys):
    out = tmp_path / "s.json"
    png = tmp_path / "s.png"
    code = simulate_cli.main(["--scenario", "long-prompt", "--model", "qwen2-0.5b", "--hardware", "textbook",
                              "--decoders", "8", "--prompt-len", "2048", "--decoder-output-len", "256",
                              "--budget", "264", "--num-kv-blocks", "2048", "--json", str(out), "--plot", str(png)])
    assert code == 0
    data = __import__("json").loads(out.read_text())
    assert {"max_decode_gap_ms", "ttft_ms", "decode_tokens_during_prefill"} <= set(data)
    assert data["decode_tokens_during_prefill"] == 8 * 8
    assert png.stat().st_size > 10_000
    assert "budget 264" in capsys.readouterr().out


def test_cli_workload_prints_json_to_stdout_and_refuses_bad_flags(capsys):
    code = simulate_cli.main(["--model", "qwen2-0.5b", "--num-requests", "20", "--prompt-len", "uniform:50:500",
                              "--output-len", "fixed:10", "--rate", "5", "--num-kv-blocks", "2048", "--policies", "stall-free,prefill-priority",
                              "--json"])
    assert code == 0
    data = __import__("json").loads(capsys.readouterr().out)
    assert set(data["results"]) == {"stall-free", "prefill-priority"}
    assert data["results"]["stall-free"]["summary"]["completed"] == 20
    assert simulate_cli.main(["--prompt-len", "gauss:3"]) == 2
    assert "bad length distribution" in capsys.readouterr().err
    assert simulate_cli.main(["--policies", "fifo"]) == 2
    assert simulate_cli.main(["--hardware", "tpu"]) == 2
    assert "unknown hardware preset" in capsys.readouterr().err


# ---- the sim executor --------------------------------------------------------------------------

from stallfree.node_daemon.engine.request import Request  # noqa: E402
from stallfree.node_daemon.engine.sampling_params import SamplingParams  # noqa: E402
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput  # noqa: E402
from stallfree.node_daemon.sim import sim_executor  # noqa: E402
from stallfree.node_daemon.sim.backend import sim_tokenizer  # noqa: E402


def _batch() -> SchedulerOutput:
    decoding = Request("d", [1] * 100, SamplingParams(max_tokens=50))
    for _ in range(9):
        decoding.append_output_token(65)
    prefilling = Request("p", [2] * 300, SamplingParams(max_tokens=5))
    chunks = [ScheduledChunk(decoding, 108, 1, False, True), ScheduledChunk(prefilling, 0, 256, True, False)]
    return SchedulerOutput(chunks=chunks, num_decode_tokens=1, num_prefill_tokens=256, token_budget=512)


def test_sim_executor_charges_the_cost_models_time_in_virtual_or_real_time(cost, monkeypatch):
    expected_ms = cost.predict_ms([109], [(0, 256)])
    clock = sim_executor.VirtualClock(5.0)
    executor = sim_executor.SimExecutor(cost, clock=clock)
    executed = executor.execute(_batch())
    assert set(executed.token_ids) == {"d"}  # the partial prefill chunk samples nothing
    assert executed.logprobs == {}
    assert clock.now == pytest.approx(5.0 + expected_ms / 1000)
    slept: list[float] = []
    monkeypatch.setattr(sim_executor.time, "sleep", slept.append)
    sim_executor.SimExecutor(cost).execute(_batch())
    assert slept == [pytest.approx(expected_ms / 1000)]


def test_placeholder_tokens_are_deterministic_readable_and_never_eos_unless_asked(cost):
    executor = sim_executor.SimExecutor(cost, clock=sim_executor.VirtualClock(), vocab_size=128256)
    tokens = [executor.placeholder_token("req-1", i) for i in range(60)]
    assert tokens == [executor.placeholder_token("req-1", i) for i in range(60)]
    text = sim_tokenizer("llama-3-8b").decode(tokens)
    assert len(text) == 60 and text.isascii() and " " in text
    eos = sim_tokenizer("llama-3-8b").eos_token_ids[0]
    assert eos not in tokens
    stopping = sim_executor.SimExecutor(cost, clock=sim_executor.VirtualClock(), eos_token_id=eos, eos_after=3)
    assert [stopping.placeholder_token("r", i) for i in range(3)][-1] == eos
    with pytest.raises(ValueError, match="eos_after"):
        sim_executor.SimExecutor(cost, eos_after=3)


def test_a_shared_prefix_is_served_from_the_prefix_cache():
    spec = dict(rate=2.0, num_requests=30, prompt=Fixed(2048), output=Fixed(8), seed=5)
    shared = simulate(generate(WorkloadSpec(**spec, shared_prefix_fraction=0.75)), MISTRAL_A100).requests
    unique = simulate(generate(WorkloadSpec(**spec)), MISTRAL_A100).requests
    assert all(r["cached_tokens"] == 0 for r in unique)
    # Every request after the first finds the 1,536-token prefix (96 full blocks) in the cache.
    assert all(r["cached_tokens"] == 1536 for r in shared[1:])
    assert sum(r["ttft_ms"] for r in shared) < 0.6 * sum(r["ttft_ms"] for r in unique)


def test_cli_over_a_trace_reports_the_traces_own_lengths_and_rate(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    rows = [(0.5 * i, 100 + 10 * i, 5 + i) for i in range(9)]  # 2 req/s, prompts 100..180, outputs 5..13
    trace.write_text("arrival_s,prompt_len,output_len\n" + "".join(f"{a},{p},{o}\n" for a, p, o in rows))
    code = simulate_cli.main(["--model", "qwen2-0.5b", "--arrival", "trace", "--trace", str(trace),
                              "--num-kv-blocks", "2048", "--json", str(tmp_path / "w.json")])
    assert code == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("9 requests on qwen2-0.5b")
    assert "prompt median 140 / p90 180 (trace)" in header and "output median 9 / p90 13 (trace)" in header
    assert f"trace {trace} 2 req/s" in header
    assert "sharegpt" not in header and "lognormal" not in header and "1 req/s" not in header
    workload = __import__("json").loads((tmp_path / "w.json").read_text())["workload"]
    assert workload["rate"] == pytest.approx(2.0) and workload["num_requests"] == 9


def test_textbook_case_is_unchanged_by_the_calibration():
    """The hand-checkable stall in node_daemon/sim/README.md: figures given by hand are achieved figures on the
    plain roofline."""
    setup = SimSetup(model="llama-3-8b", tflops=400, hbm_tbps=3, overhead_ms=0, max_model_len=8193, max_num_seqs=65)
    stalled = long_prompt_scenario(setup, 64, 8192, 1024, 2048, no_chunking=True)
    assert (round(stalled["max_decode_gap_ms"], 1), round(stalled["ttft_ms"], 1)) == (337.8, 329.9)
    chunked = long_prompt_scenario(SimSetup(**{**setup.__dict__, "token_budget": 576}), 64, 8192, 1024, 2048)
    assert (round(chunked["max_decode_gap_ms"], 1), round(chunked["ttft_ms"], 1)) == (28.7, 417.5)
    assert chunked["decode_tokens_during_prefill"] == 1024 and chunked["prefill_iterations"] == 16
