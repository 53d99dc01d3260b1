"""Scheduler rules, one at a time: stall-free order, limits, KV admission, preemption, stopping."""
from __future__ import annotations

import pytest
from scheduler_driver import (EOS, check_blocks_conserved, checked_step, make_request, make_scheduler,
                              run_to_completion, sample_tokens)

from stallfree.contracts import Tuning, TuningError
from stallfree.node_daemon.engine.output_length import OutputLengthEstimate
from stallfree.node_daemon.engine.request import RequestStatus


def step(scheduler, token: int = 7):
    return checked_step(scheduler, lambda request: token)


def layout(output) -> list[tuple[str, int, int, bool]]:
    return [(c.request.request_id, c.start, c.num_tokens, c.is_prefill) for c in output.chunks]


# ---- stall-free order and the live limits ---------------------------------------------------------

def test_decodes_first_then_partial_prefill_then_new_prompts_cut_at_the_budget():
    s = make_scheduler(num_blocks=128, token_budget=48, max_num_seqs=8, max_partial_prefills=2, prefix_caching=False)
    s.add_request(make_request("d", 8, max_tokens=50))
    step(s)  # "d" prefills whole and samples: now it decodes
    s.add_request(make_request("long", 100))
    s.add_request(make_request("new", 30))
    output, _ = step(s)
    assert layout(output) == [("d", 8, 1, False), ("long", 0, 47, True)]
    output, _ = step(s)
    # "long" continues before "new" starts, each cut at what the budget leaves.
    assert layout(output) == [("d", 9, 1, False), ("long", 47, 47, True)]
    output, _ = step(s)
    assert layout(output) == [("d", 10, 1, False), ("long", 94, 6, True), ("new", 0, 30, True)]
    assert output.num_decode_tokens == 1 and output.num_prefill_tokens == 36 and output.token_budget == 48


def test_a_chunk_that_reaches_the_newest_token_samples_and_the_others_do_not():
    s = make_scheduler(num_blocks=64, token_budget=40, max_num_seqs=4, prefix_caching=False)
    s.add_request(make_request("a", 60))
    first, _ = step(s)
    assert [c.samples for c in first.chunks] == [False]
    assert s.get_request("a").output_token_ids == () and s.get_request("a").num_computed_tokens == 40
    second, _ = step(s)
    assert [c.samples for c in second.chunks] == [True]
    assert s.get_request("a").output_token_ids == (7,)


def test_long_prefill_threshold_caps_each_chunk():
    s = make_scheduler(num_blocks=64, token_budget=64, long_prefill_threshold=10, max_partial_prefills=2)
    s.add_request(make_request("a", 25))
    s.add_request(make_request("b", 25))
    output, _ = step(s)
    assert layout(output) == [("a", 0, 10, True), ("b", 0, 10, True)]


def test_max_partial_prefills_caps_new_partial_prefills_in_fcfs_order():
    s = make_scheduler(num_blocks=128, token_budget=40, max_partial_prefills=1, long_prefill_threshold=16)
    s.add_request(make_request("a", 50))
    s.add_request(make_request("b", 50))
    output, _ = step(s)
    assert layout(output) == [("a", 0, 16, True)] and s.num_partial_prefills == 1
    s.set_tuning(Tuning(token_budget=40, max_num_seqs=8, max_partial_prefills=2, long_prefill_threshold=16))
    output, _ = step(s)
    assert layout(output) == [("a", 16, 16, True), ("b", 0, 16, True)] and s.num_partial_prefills == 2


def test_a_prompt_that_completes_in_the_iteration_is_not_a_partial_prefill():
    s = make_scheduler(num_blocks=128, token_budget=64, max_partial_prefills=1, long_prefill_threshold=20)
    s.add_request(make_request("long", 60))
    s.add_request(make_request("short", 12))
    output, _ = step(s)
    assert layout(output) == [("long", 0, 20, True), ("short", 0, 12, True)]
    assert s.num_partial_prefills == 1


def test_max_num_seqs_limits_admission():
    s = make_scheduler(num_blocks=128, token_budget=64, max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 4, max_tokens=10))
    output, _ = step(s)
    assert [c.request.request_id for c in output.chunks] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 2


def test_lowering_max_num_seqs_live_preempts_the_latest_admitted():
    s = make_scheduler(num_blocks=128, token_budget=64, max_num_seqs=4)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 4, max_tokens=20))
    step(s)
    s.set_tuning(Tuning(token_budget=64, max_num_seqs=2))
    output, _ = step(s)
    assert [r.request_id for r in output.preempted] == ["r3", "r2"]
    assert [c.request.request_id for c in output.chunks] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]  # resume ahead of new ones, in admission order
    assert s.num_preemptions == 2 and s.get_request("r2").status is RequestStatus.PREEMPTED
    check_blocks_conserved(s)


def test_set_tuning_rejects_a_budget_without_prefill_room_and_keeps_the_old_one():
    s = make_scheduler(token_budget=64, max_num_seqs=8)
    before = s.tuning
    with pytest.raises(TuningError, match="prefill room"):
        s.set_tuning(Tuning(token_budget=20, max_num_seqs=8))
    with pytest.raises(TuningError, match="ceiling"):
        s.set_tuning(Tuning(token_budget=64, max_num_seqs=1000))
    assert s.tuning == before


def test_set_tuning_takes_effect_at_the_next_schedule():
    s = make_scheduler(num_blocks=128, token_budget=64, max_num_seqs=8)
    s.add_request(make_request("a", 200))
    s.set_tuning(Tuning(token_budget=100, max_num_seqs=8))
    output, _ = step(s)
    assert output.num_prefill_tokens == 100 and output.token_budget == 100


# ---- bad input: checked before the scheduler (engine/request_rules.py, tests/test_request_rules.py) ------------

@pytest.mark.parametrize(
    "request_kwargs, broken",
    [
        (dict(prompt=[]), "a prompt of 0 tokens"),
        (dict(prompt=300), "a prompt of 300 tokens in a context of 256"),
        (dict(prompt=200, max_tokens=50), "in a cache of 16 blocks"),
    ],
)
def test_a_request_that_breaks_the_rules_is_a_bug_of_its_caller_and_changes_nothing(request_kwargs, broken):
    s = make_scheduler(num_blocks=16, block_size=4)
    s.add_request(make_request("ok", 5))
    with pytest.raises(AssertionError, match=broken):
        s.add_request(make_request("bad", **request_kwargs))
    assert s.get_request("bad") is None and s.num_waiting == 1


def test_the_length_rule_leaves_room_for_one_output_token():
    s = make_scheduler(max_model_len=12)
    with pytest.raises(AssertionError, match="a prompt of 12 tokens in a context of 12"):
        s.add_request(make_request("full", 12))
    s.add_request(make_request("fits", 11, max_tokens=50))  # max_tokens past the context is accepted
    (done,) = run_to_completion(s)
    assert done.num_output_tokens == 1 and done.num_tokens == 12 and done.status is RequestStatus.FINISHED_LENGTH


def test_a_duplicate_id_breaks_an_invariant():
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    with pytest.raises(AssertionError, match="already in flight"):
        s.add_request(make_request("a", 5))


# ---- aborts and stopping -----------------------------------------------------------------------------

def test_abort_frees_blocks_at_once_and_disturbs_no_one_else():
    s = make_scheduler(num_blocks=64, token_budget=64)
    s.add_request(make_request("a", 20, max_tokens=5))
    s.add_request(make_request("b", 20, max_tokens=5))
    s.add_request(make_request("queued", 8, max_tokens=5))
    s.set_tuning(Tuning(token_budget=64, max_num_seqs=2))
    step(s)
    used = s.kv_cache.num_used_blocks
    aborted = s.abort_request("a")
    assert aborted is not None and aborted.status is RequestStatus.FINISHED_ABORTED and aborted.block_ids == []
    assert s.kv_cache.num_used_blocks == used - 5
    assert s.abort_request("queued").status is RequestStatus.FINISHED_ABORTED
    assert s.abort_request("a") is None and s.abort_request("nope") is None
    finished = run_to_completion(s)
    assert [r.request_id for r in finished] == ["b"] and len(finished[0].output_token_ids) == 5
    assert s.kv_cache.num_used_blocks == 0


def test_abort_between_schedule_and_update_skips_the_request():
    s = make_scheduler()
    s.add_request(make_request("a", 8, max_tokens=3))
    s.add_request(make_request("b", 8, max_tokens=3))
    output = s.schedule()
    s.abort_request("a")
    finished = s.update_from_output(output, sample_tokens(output, lambda r: 7))
    assert finished == [] and s.get_request("a") is None
    assert s.get_request("b").output_token_ids == (7,)
    check_blocks_conserved(s)


def test_eos_stops_unless_ignored_and_stop_token_ids_always_stop():
    s = make_scheduler()
    s.add_request(make_request("eos", 4, max_tokens=10, ignore_eos=False))
    s.add_request(make_request("ignored", 4, max_tokens=10, ignore_eos=True))
    s.add_request(make_request("stop_id", 4, max_tokens=10, ignore_eos=True, stop_token_ids=[EOS]))
    _, finished = step(s, token=EOS)
    assert sorted(r.request_id for r in finished) == ["eos", "stop_id"]
    assert all(r.status is RequestStatus.FINISHED_STOPPED for r in finished)
    assert s.get_request("ignored").status is RequestStatus.RUNNING


def test_max_tokens_and_max_model_len_finish_with_length():
    s = make_scheduler(max_model_len=12)
    s.add_request(make_request("max_tokens", 4, max_tokens=3))
    s.add_request(make_request("context", 10, max_tokens=50))
    finished = run_to_completion(s)
    by_id = {r.request_id: r for r in finished}
    assert len(by_id["max_tokens"].output_token_ids) == 3
    assert by_id["context"].num_tokens == 12
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in finished)


def test_finish_request_is_how_the_engine_stops_on_a_stop_string():
    s = make_scheduler()
    s.add_request(make_request("a", 4, max_tokens=10))
    step(s)
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert not s.has_unfinished() and s.kv_cache.num_used_blocks == 0
    with pytest.raises(ValueError, match="not a finished status"):
        s.finish_request("a", RequestStatus.RUNNING)


# ---- KV admission, preemption and prefix caching -----------------------------------------------------

def test_admission_counts_the_final_footprint_not_the_prompt():
    # 16 blocks of 4: each request needs 4 prompt + 27 generated = 31 KV tokens = 8 blocks at the end.
    s = make_scheduler(num_blocks=16, block_size=4, token_budget=64)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, max_tokens=28))
    output, _ = step(s)
    assert [c.request.request_id for c in output.chunks] == ["r0", "r1"]  # their prompts alone would all fit
    finished = run_to_completion(s)
    assert s.num_preemptions == 0 and len(finished) == 3


def test_watermark_is_kept_unless_the_request_would_run_alone():
    s = make_scheduler(num_blocks=16, block_size=4, token_budget=64, watermark_blocks=4)
    s.add_request(make_request("a", 4, max_tokens=28))  # 8 blocks
    s.add_request(make_request("b", 4, max_tokens=25))  # 7 blocks: 8 + 7 + watermark 4 > 16
    output, _ = step(s)
    assert [c.request.request_id for c in output.chunks] == ["a"]
    big = make_scheduler(num_blocks=16, block_size=4, token_budget=64, watermark_blocks=4)
    big.add_request(make_request("alone", 4, max_tokens=60))  # all 16 blocks, admitted despite the watermark
    assert len(run_to_completion(big)[0].output_token_ids) == 60


def test_kv_shortfall_preempts_the_latest_admitted_which_resumes_first_and_finishes():
    # Reserving no output tokens admits all three prompts; decoding then runs out of blocks.
    s = make_scheduler(num_blocks=10, block_size=4, token_budget=64, max_num_seqs=3,
                       output_estimate=OutputLengthEstimate.fixed(0))
    for i in range(3):
        s.add_request(make_request(f"r{i}", 6, max_tokens=10))
    s.add_request(make_request("later", 6, max_tokens=2))
    preempted = []
    finished = []
    while s.has_unfinished():
        waiting_before = {r.request_id for r in s.waiting}
        output, done = step(s)
        preempted += [r.request_id for r in output.preempted]
        if output.preempted:
            assert s.waiting[0] is output.preempted[-1]  # ahead of "later"
            # No admission in an iteration that preempted: the victim must not take its room back.
            not_admissible = waiting_before | {r.request_id for r in output.preempted}
            assert not {c.request.request_id for c in output.chunks} & not_admissible
        finished += done
    assert preempted and preempted[0] == "r2"
    assert sorted(r.request_id for r in finished) == ["later", "r0", "r1", "r2"]
    assert all(len(r.output_token_ids) == r.sampling.max_tokens for r in finished)
    assert all(r.num_cached_tokens <= r.num_prompt_tokens for r in finished)  # usage counts prompt tokens only
    assert s.get_request("r2") is None and s.num_preemptions == len(preempted)


def test_a_lone_request_that_fills_the_cache_progresses():
    s = make_scheduler(num_blocks=4, block_size=4, token_budget=64, output_estimate=OutputLengthEstimate.fixed(0))
    s.add_request(make_request("a", 3, max_tokens=13))  # 15 KV tokens in 16 slots
    (request,) = run_to_completion(s)
    assert len(request.output_token_ids) == 13 and s.num_preemptions == 0


def test_prefix_cache_hit_skips_prefill_but_computes_the_last_token():
    s = make_scheduler(num_blocks=64, block_size=4, token_budget=64)
    prompt = list(range(20, 30))  # 10 tokens: two full blocks
    s.add_request(make_request("first", prompt, max_tokens=2))
    run_to_completion(s)
    s.add_request(make_request("again", prompt, max_tokens=2))
    output, _ = step(s)
    assert layout(output) == [("again", 8, 2, True)] and output.chunks[0].samples
    assert s.get_request("again").num_cached_tokens == 8
    exact = list(range(20, 28))  # 8 tokens = two full cached blocks: the second is recomputed
    s.add_request(make_request("exact", exact, max_tokens=2))
    output, _ = step(s)
    assert ("exact", 4, 4, True) in layout(output)
    assert s.get_request("exact").num_cached_tokens == 4


def test_decode_blocks_are_cached_as_they_fill():
    s = make_scheduler(num_blocks=64, block_size=4)
    s.add_request(make_request("a", 5, max_tokens=8))
    run_to_completion(s, token_of=lambda r: 11)
    # 5 prompt + 7 fed-back outputs = 12 computed tokens: three full blocks, outputs included.
    assert s.kv_cache.pool.num_cached_blocks == 3
