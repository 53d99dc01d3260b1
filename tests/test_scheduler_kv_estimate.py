"""KV reserved by an estimate of the output length, not the worst case (issue 12).

The scenario of the CPU daemon, scaled down: chats without max_tokens (so max_tokens is the whole
remaining context, as the server sets it) on a KV cache that holds the worst case of only three.
"""
from __future__ import annotations

import zlib

import pytest
from scheduler_driver import EOS, checked_step, make_scheduler

from stallfree.node_daemon.engine.output_length import OutputLengthEstimate
from stallfree.node_daemon.engine.request import Request, RequestStatus
from stallfree.node_daemon.engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 512
BLOCK_SIZE = 8
NUM_BLOCKS = 200  # 1,600 tokens: 32 short chats fit, the worst case (prompt + 492 outputs) of only 3 does
PROMPT_LEN = 20


def output_len(request_id: str) -> int:
    """Where a chat ends with EOS: after 30-60 tokens, every eighth after 100.

    With an estimate of 24 outputs, all 32 chats are admitted at once (6 blocks each, 192 of 200), but
    together they grow to over 210 blocks: the estimate is wrong and KV runs out mid-decode.
    """
    n = int(request_id.split("-")[1]) if request_id.startswith("chat-") else 0
    return 100 if n % 8 == 7 else 30 + zlib.crc32(request_id.encode()) % 31


def next_token(request: Request) -> int:
    """EOS at the request's output length, else a token that depends on the position (checks recompute)."""
    if request.num_output_tokens + 1 >= output_len(request.request_id):
        return EOS
    return 10 + (request.num_tokens * 7 + zlib.crc32(request.request_id.encode())) % 50


def chat(request_id: str, max_tokens: int | None = None) -> Request:
    seed = zlib.crc32(request_id.encode())
    prompt = [10 + (seed + 3 * i) % 50 for i in range(PROMPT_LEN)]
    room = MAX_MODEL_LEN - PROMPT_LEN  # the server's max_tokens for a chat that gives none
    sampling = SamplingParams(max_tokens=max_tokens or room, ignore_eos=False)
    return Request(request_id, prompt, sampling, eos_token_ids=(EOS,), arrival_time=0.0,
                   max_model_len=MAX_MODEL_LEN)


def expected_output(request_id: str) -> list[int]:
    """The tokens a request must end with, computed by feeding next_token without any scheduler."""
    request = chat(request_id)
    while True:
        token = next_token(request)
        request.append_output_token(token)
        if token == EOS:
            return list(request.output_token_ids)


def run_scenario(estimate: OutputLengthEstimate, max_num_seqs: int = 64, max_steps: int = 5000) -> dict:
    """32 chats, then a max_tokens=2 request behind them; step until all finish (checked every step)."""
    s = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, token_budget=256, max_num_seqs=max_num_seqs,
                       max_model_len=MAX_MODEL_LEN, output_estimate=estimate)
    for i in range(32):
        s.add_request(chat(f"chat-{i}"))
    s.add_request(chat("short", max_tokens=2))
    peak_running, peak_chats, admitted_at, finished = 0, 0, {}, {}
    for step in range(max_steps):
        if not s.has_unfinished():
            break
        output, done = checked_step(s, next_token)
        for chunk in output.chunks:
            admitted_at.setdefault(chunk.request.request_id, step)
        peak_running = max(peak_running, s.num_running)
        peak_chats = max(peak_chats, sum(1 for r in s.running if r.request_id.startswith("chat-")))
        for request in done:
            finished[request.request_id] = (step, request)
    else:
        raise AssertionError("the requests did not finish")
    return {"scheduler": s, "peak_running": peak_running, "peak_chats": peak_chats, "admitted_at": admitted_at,
            "finished": finished}


def test_chats_without_max_tokens_run_together_and_every_one_completes_exactly():
    result = run_scenario(OutputLengthEstimate(initial=24, floor=8))
    s, finished = result["scheduler"], result["finished"]
    assert result["peak_running"] == 33  # all 32 chats and the short request at once, under max_num_seqs 64
    assert len(finished) == 33
    # The four long chats outran the estimate: KV ran out and requests were preempted by recompute ...
    assert s.num_preemptions > 0
    assert any(request.num_preemptions for _, request in finished.values())
    # ... and lost nothing: each ends with exactly the tokens it would have produced alone, by EOS.
    for request_id, (_, request) in finished.items():
        if request_id != "short":
            assert request.status is RequestStatus.FINISHED_STOPPED
            assert list(request.output_token_ids) == expected_output(request_id), request_id
    kv = s.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and s.num_reserved_blocks == 0


def test_a_two_token_request_behind_them_finishes_within_a_few_iterations_of_its_turn():
    result = run_scenario(OutputLengthEstimate(initial=24, floor=8))
    finished_at, short = result["finished"]["short"]
    assert short.num_output_tokens == 2 and short.status is RequestStatus.FINISHED_LENGTH
    turn = max(result["admitted_at"][f"chat-{i}"] for i in range(32))  # the chats ahead of it are all in
    assert result["admitted_at"]["short"] <= turn + 1
    assert finished_at <= turn + 3


def test_max_num_seqs_still_caps_how_many_run():
    result = run_scenario(OutputLengthEstimate(initial=24, floor=8), max_num_seqs=16)
    assert result["peak_running"] == 16 and len(result["finished"]) == 33


def test_the_worst_case_reservation_serialises_the_same_chats():
    """Today's rule, for contrast: three chats at a time, and the short request waits for whole chats."""
    result = run_scenario(OutputLengthEstimate.worst_case())
    assert result["peak_chats"] == 3 and result["scheduler"].num_preemptions == 0
    estimated = run_scenario(OutputLengthEstimate(initial=24, floor=8))
    assert result["finished"]["short"][0] > 10 * estimated["finished"]["short"][0]


def test_admission_reserves_the_estimate_capped_by_the_requests_own_max_tokens():
    s = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, token_budget=256, max_model_len=MAX_MODEL_LEN,
                       output_estimate=OutputLengthEstimate.fixed(60))
    s.add_request(chat("unbounded"))
    checked_step(s, next_token)
    # 20 prompt tokens + 60 estimated outputs - 1 (the last token needs no KV) = 79 tokens: 10 blocks.
    assert s.num_reserved_blocks == 10 and s.kv_cache.num_used_blocks == 3
    s.add_request(chat("bounded", max_tokens=2))  # its own bound is below the estimate: 21 tokens, 3 blocks
    checked_step(s, next_token)
    assert s.num_reserved_blocks == 13
    assert s.kv_reserved == pytest.approx(13 / NUM_BLOCKS)


def test_a_prompt_is_admitted_only_when_its_whole_footprint_fits():
    s = make_scheduler(num_blocks=6, block_size=BLOCK_SIZE, token_budget=34, max_num_seqs=2, long_prefill_threshold=16,
                       max_model_len=MAX_MODEL_LEN, max_partial_prefills=2,
                       output_estimate=OutputLengthEstimate.fixed(0))
    s.add_request(Request("big", list(range(10, 50)), SamplingParams(max_tokens=4), arrival_time=0.0))  # 5 blocks
    s.add_request(Request("next", list(range(10, 26)), SamplingParams(max_tokens=4), arrival_time=0.0))
    output, _ = checked_step(s)
    # "big" got a 16-token chunk but reserved its whole prompt, so "next" (2 blocks) waits although free.
    assert [c.request.request_id for c in output.chunks] == ["big"] and s.num_waiting == 1
    assert s.num_reserved_blocks == 5 and s.kv_cache.num_used_blocks == 2


def test_the_estimate_learns_from_requests_that_ended_by_themselves():
    estimate = OutputLengthEstimate(initial=100, floor=8, margin=1.5, quantile=0.9)
    for n in range(1, 11):  # stopped by EOS after 10, 20, ..., 100 tokens
        estimate.observe(10 * n, stopped=True)
    assert estimate.tokens == 135  # p90 = 90, times 1.5
    estimate.observe(2, stopped=False)  # cut by its own max_tokens=2: says nothing about unbounded chats
    assert estimate.tokens == 135 and estimate.num_observed == 10
    estimate.observe(400, stopped=False)  # cut by a limit above the estimate: it ran at least that long
    assert estimate.num_observed == 11 and estimate.tokens == 150  # p90 of 11 samples is now 100
    tiny = OutputLengthEstimate(initial=4, floor=16)
    tiny.observe(1, stopped=True)
    assert tiny.tokens == 16  # never below the floor


def test_fixed_estimates_do_not_learn():
    for estimate in (OutputLengthEstimate.fixed(0), OutputLengthEstimate.worst_case()):
        before = estimate.tokens
        estimate.observe(1000, stopped=True)
        assert estimate.tokens == before


def test_a_resumed_request_that_outran_the_estimate_reserves_as_much_again():
    # Two chats reserve 20 + 8 - 1 = 27 tokens (4 blocks) each; 10 blocks hold both only up to 40 tokens.
    s = make_scheduler(num_blocks=10, block_size=BLOCK_SIZE, token_budget=256, max_model_len=MAX_MODEL_LEN,
                       output_estimate=OutputLengthEstimate.fixed(8))
    first, second = chat("first", max_tokens=60), chat("second", max_tokens=60)  # bound: 79 tokens, 10 blocks
    s.add_request(first)
    s.add_request(second)
    lengths = {"first": 30, "second": 36}

    def token_of(request: Request) -> int:
        return EOS if request.num_output_tokens + 1 >= lengths[request.request_id] else 11

    while second.num_preemptions == 0:
        checked_step(s, token_of)
    outputs_then = second.num_output_tokens
    assert s.num_waiting == 1 and outputs_then >= 8  # it outran its 8 estimated tokens before KV ran out
    while second.status is not RequestStatus.RUNNING:
        checked_step(s, token_of)
    # Re-admitted only once "first" left room for its prompt plus twice the outputs it had.
    assert first.finished
    assert s.num_reserved_blocks == -(-(PROMPT_LEN + 2 * outputs_then - 1) // BLOCK_SIZE)
    while s.has_unfinished():
        checked_step(s, token_of)
    assert second.num_output_tokens == 36 and second.num_preemptions == 1


def test_bad_estimate_parameters_are_refused():
    with pytest.raises(ValueError, match="quantile"):
        OutputLengthEstimate(quantile=0.0)
    with pytest.raises(ValueError):
        OutputLengthEstimate(margin=-1.0)


def test_the_engine_reports_reserved_kv_and_evicted_blocks_each_iteration():
    from stallfree.contracts import Ceilings, Tuning
    from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.engine.engine import LLMEngine

    class Recorder:
        def __init__(self) -> None:
            self.records = []

        def on_iteration(self, record) -> None:
            self.records.append(record)

        def on_token(self, request, now, first) -> None:
            pass

        def on_finished(self, request, now) -> None:
            pass

    recorder = Recorder()
    config = EngineConfig(model=ModelConfig(model="tiny", max_model_len=256),
                          cache=CacheConfig(block_size=16, num_blocks=12),
                          scheduler=SchedulerConfig(ceilings=Ceilings(max_token_budget=256, max_num_seqs=4),
                                                    tuning=Tuning(token_budget=256, max_num_seqs=4)))
    engine = LLMEngine(config, observer=recorder)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for request_id, first_token in (("a", 1), ("b", 200)):  # different prompts: b evicts a's cached blocks
        engine.add_request(request_id, prompt_token_ids=[first_token + i for i in range(100)], sampling=greedy)
        while engine.has_unfinished():
            engine.step()
    first = recorder.records[0]
    # 100 prompt tokens held (7 blocks of 12); reserved: its bound, 100 + 40 - 1 tokens = 9 blocks.
    assert first.kv_usage == pytest.approx(7 / 12) and first.kv_reserved == pytest.approx(9 / 12)
    evicted = sum(r.num_evicted_blocks for r in recorder.records)
    assert evicted == engine.kv_cache.num_evictions > 0
