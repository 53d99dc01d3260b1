"""n-gram speculation without a model: the drafter, its adaptation, the budget and KV roll-back in the scheduler, and
the exactness of the verifier's rejection sampling (a chi-square test over seeded draws)."""
from __future__ import annotations

import math
import random

import pytest
import torch
from scheduler_driver import checked_step, make_request, make_scheduler

from stallfree.node_daemon.engine.draft_verifier import verify_draft
from stallfree.node_daemon.engine.request import Objective
from stallfree.node_daemon.engine.sampler import Sampler
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.speculation import (FIRST_COOLDOWN, PROBE_LEN, DraftState, SpeculativeConfig,
                                                      can_draft)

NGRAM = SpeculativeConfig(method="ngram", max_draft=4)


# ---- drafting ----------------------------------------------------------------------------------

def test_a_draft_continues_the_latest_earlier_occurrence_of_the_longest_matching_suffix():
    state = DraftState(SpeculativeConfig(method="ngram", ngram_max=3, ngram_min=1))
    # "7 8 9" occurs at 0 and 5; the latest earlier occurrence (at 5) is followed by 4 5.
    tokens = [7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9]
    assert state.propose(tokens, 3) == [4, 5, 6]
    assert state.propose(tokens, 1) == [4]
    tokens += [4, 5, 3]  # "5 3" never occurred: the 1-gram "3" neither; no draft
    assert state.propose(tokens, 4) == []
    tokens += [2]  # "3 2" no, "2" yes (at 4): followed by 7 8 9 ...
    assert state.propose(tokens, 2) == [7, 8]


def test_a_draft_stops_at_the_context_end():
    state = DraftState(SpeculativeConfig(method="ngram", ngram_max=2, ngram_min=2))
    assert state.propose([1, 2, 3, 1, 2], 8) == [3, 1, 2]
    assert state.propose([1, 2], 8) == []


def test_drafting_turns_off_where_it_is_not_accepted_and_probes_again():
    state = DraftState(NGRAM)
    assert state.draft_len() == 4
    state.observe(4, 0)
    state.observe(1, 0)
    assert state.cooldown == FIRST_COOLDOWN
    lens = [state.draft_len() for _ in range(FIRST_COOLDOWN)]
    assert lens[:-1] == [0] * (FIRST_COOLDOWN - 1) and lens[-1] == PROBE_LEN
    state.observe(PROBE_LEN, 0)  # the probe fails: a twice longer cooldown
    assert state.cooldown == 2 * FIRST_COOLDOWN
    assert state.num_drafted == 5 + PROBE_LEN and state.num_accepted == 0


def test_an_accepted_draft_grows_the_next_and_a_partial_one_shortens_it():
    state = DraftState(SpeculativeConfig(method="ngram", max_draft=8))
    state.observe(4, 4)
    assert state.draft_len() == 6
    state.observe(6, 1)
    assert state.draft_len() == 2 and state.cooldown == 0


def test_only_requests_whose_outputs_stay_exact_are_drafted_for():
    assert can_draft(SamplingParams(temperature=0.0), constrained=False)
    assert can_draft(SamplingParams(temperature=0.7, top_p=0.9, logit_bias={3: 1.0}), constrained=False)
    assert not can_draft(SamplingParams(temperature=0.0), constrained=True)
    assert not can_draft(SamplingParams(temperature=0.0, repetition_penalty=1.2), constrained=False)
    assert not can_draft(SamplingParams(temperature=0.7, seed=3), constrained=False)
    assert can_draft(SamplingParams(temperature=0.0, seed=3), constrained=False)


# ---- the scheduler: budget and roll-back -------------------------------------------------------

PATTERN = [11, 12, 13, 14, 15]


def speculating_scheduler(**kwargs):
    s = make_scheduler(block_size=4, prefix_caching=False, **kwargs)
    s.speculative = NGRAM
    return s


def decode_ready(s, request_id: str = "d", max_tokens: int = 50):
    """A request whose prompt repeats PATTERN, past its prefill, whose newest token continues the pattern."""
    s.add_request(make_request(request_id, PATTERN * 4, max_tokens=max_tokens))
    while s.get_request(request_id).num_output_tokens == 0:
        out = s.schedule()
        s.update_from_output(out, {c.request.request_id: PATTERN[0] for c in out.chunks if c.samples})
    return s.get_request(request_id)


def test_verification_tokens_count_in_the_budget_before_prefill_chunks():
    s = speculating_scheduler(token_budget=34, max_num_seqs=2, num_blocks=64)
    d = decode_ready(s)
    s.add_request(make_request("w", 60, max_tokens=4))
    out = s.schedule()
    verify, prefill = out.chunks
    assert verify.request is d and verify.draft == PATTERN[1:] and verify.num_tokens == 1 + 4
    assert not verify.is_prefill and verify.start == d.num_computed_tokens
    assert prefill.request.request_id == "w" and prefill.num_tokens == 34 - 5
    assert (out.num_decode_tokens, out.num_verify_tokens, out.num_prefill_tokens) == (1, 4, 29)
    assert out.num_tokens == out.token_budget == 34
    assert len(d.block_ids) * 4 >= verify.start + verify.num_tokens  # KV slots for every verified row


def test_drafts_take_only_what_the_decodes_leave_and_respect_max_tokens():
    s = make_scheduler(block_size=4, prefix_caching=False, token_budget=34, max_num_seqs=2, num_blocks=64)
    config = SpeculativeConfig(method="ngram", max_draft=64)
    s.speculative = config
    s.add_request(make_request("a", list(range(100, 150)) + [100, 101], max_tokens=80))
    a = s.get_request("a")
    while not a.num_output_tokens:  # then "100 101 102" occurred at the start: 47 tokens follow it
        out = s.schedule()
        s.update_from_output(out, {"a": 102} if out.chunks[0].samples else {})
    a.draft_state = DraftState(config)
    a.draft_state.next_len = 64
    out = s.schedule()
    assert out.chunks[0].draft == list(range(103, 103 + 33))  # the budget's 34 less the decode
    assert out.num_tokens == out.token_budget == 34
    s2 = speculating_scheduler(token_budget=64, num_blocks=64)
    r = decode_ready(s2, "c", max_tokens=3)  # one output so far: this step may give at most 2 more
    out = s2.schedule()
    assert len(out.chunks[0].draft) == 1 and r.num_output_tokens == 1


def test_drafts_stop_where_the_iterations_rows_stop_being_cheap():
    def decodes(n):
        s = make_scheduler(block_size=4, prefix_caching=False, token_budget=64, max_num_seqs=8, num_blocks=256)
        for i in range(n):  # without speculation, so no draft state is cooling down
            decode_ready(s, f"r{i}")
        s.speculative = SpeculativeConfig(method="ngram", max_draft=4, max_rows=8)
        return s.schedule()

    out = decodes(3)
    assert out.num_decode_tokens == 3 and out.num_verify_tokens == 8 - 3  # 4 for the first, 1 for the second
    out = decodes(8)
    assert out.num_decode_tokens == 8 and out.num_verify_tokens == 0  # no cheap row left


def test_rejected_draft_tokens_are_rolled_back():
    s = speculating_scheduler(token_budget=64, num_blocks=64)
    d = decode_ready(s)
    out = s.schedule()
    chunk = out.chunks[0]
    start, blocks_before = chunk.start, len(d.block_ids)
    assert chunk.draft == [12, 13, 14, 15]
    s.update_from_output(out, {"d": 99}, accepted={"d": 1})
    assert d.output_token_ids[-3:] == (11, 12, 99)
    assert d.num_computed_tokens == start + 2  # the newest token and the one accepted draft token
    assert len(d.block_ids) == -(-d.num_computed_tokens // 4) <= blocks_before
    assert d.num_drafted_tokens == 4 and d.num_accepted_tokens == 1
    free_before = s.kv_cache.num_free_blocks
    out = s.schedule()  # the next step writes from the first rejected slot on
    assert out.chunks[0].start == start + 2
    assert s.kv_cache.num_free_blocks <= free_before


def test_an_accepted_draft_token_that_stops_the_request_ends_it_there():
    s = speculating_scheduler(token_budget=64, num_blocks=64)
    s.add_request(make_request("d", PATTERN * 4, max_tokens=50, ignore_eos=False,
                               stop_token_ids=[PATTERN[2]]))
    while s.get_request("d").num_output_tokens == 0:
        out = s.schedule()
        s.update_from_output(out, {c.request.request_id: PATTERN[0] for c in out.chunks if c.samples})
    d = s.get_request("d")
    out = s.schedule()
    assert out.chunks[0].draft[:2] == PATTERN[1:3]
    finished = s.update_from_output(out, {"d": 5}, accepted={"d": len(out.chunks[0].draft)})
    assert finished == [d] and d.status.value == "stop" and d.output_token_ids == (11, 12, 13)
    assert s.kv_cache.num_used_blocks == 0


def test_a_lower_priority_does_not_draft_while_a_higher_one_waits_to_prefill():
    s = speculating_scheduler(token_budget=34, max_num_seqs=2, num_blocks=64)
    low = make_request("low", PATTERN * 4, max_tokens=50)
    low.objective = Objective("batch", priority=0)
    s.add_request(low)
    while not low.num_output_tokens:
        out = s.schedule()
        s.update_from_output(out, {c.request.request_id: PATTERN[0] for c in out.chunks if c.samples})
    high = make_request("high", 60, max_tokens=4)
    high.objective = Objective("chat", priority=5)
    s.add_request(high)
    out = s.schedule()
    assert out.num_verify_tokens == 0 and out.chunks[0].draft == ()
    assert out.chunks[1].request is high and out.chunks[1].num_tokens == 33
    while high.num_computed_tokens < high.num_prompt_tokens:
        out = s.schedule()
        s.update_from_output(out, {c.request.request_id: PATTERN[0] for c in out.chunks if c.samples})
    assert s.schedule().num_verify_tokens > 0  # nothing of a higher priority prefills: the drafts resume


def test_the_cost_model_sees_a_verification_as_the_decode_rows_it_runs_as():
    from stallfree.node_daemon.engine.engine import _observe_iteration

    s = speculating_scheduler(token_budget=34, max_num_seqs=2, num_blocks=64)
    d = decode_ready(s)
    out = s.schedule()
    seen = []
    _observe_iteration(lambda decodes, chunks, ms: seen.append((decodes, chunks)), out, 5.0)
    start = d.num_computed_tokens
    assert seen == [([start + 1, start + 2, start + 3, start + 4, start + 5], [])]


def test_random_workloads_with_drafts_keep_every_kv_and_block_invariant():
    """Requests of repeating prompts, KV tight enough to preempt, prefix caching on, drafts accepted at random: every
    position a chunk attends to holds its own token (rejected slots are written again before they are read), blocks
    are conserved, and everything finishes."""
    rng = random.Random(45)
    s = make_scheduler(num_blocks=40, block_size=4, token_budget=40, max_num_seqs=6, max_partial_prefills=2)
    s.speculative = SpeculativeConfig(method="ngram", max_draft=6, ngram_min=1)
    for i in range(24):
        unit = [10 + rng.randrange(8) for _ in range(rng.randrange(2, 6))]
        s.add_request(make_request(f"q{i}", (unit * 12)[:rng.randrange(6, 40)], max_tokens=rng.randrange(4, 30)))
    drafted = accepted_total = 0

    def accept(request, draft):
        nonlocal drafted, accepted_total
        n = rng.randrange(len(draft) + 1)
        drafted, accepted_total = drafted + len(draft), accepted_total + n
        return n

    for _ in range(3000):
        if not s.has_unfinished():
            break
        output, _ = checked_step(s, lambda r: 10 + rng.randrange(8), accept_of=accept)
        assert output.num_tokens <= output.token_budget
    assert not s.has_unfinished() and drafted > 50 and 0 < accepted_total < drafted
    assert s.kv_cache.num_used_blocks == 0


# ---- exact rejection sampling ------------------------------------------------------------------

# The 0.1% critical values of chi-square by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59}


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> list[float]:
    """The sampler's distribution, computed plainly: bias, temperature, top-k, then top-p over what top-k kept."""
    x = logits.double().clone()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    p = torch.softmax(x / params.temperature, dim=-1)
    order = torch.argsort(p, descending=True).tolist()
    keep = order[:params.top_k] if params.top_k > 0 else order
    total = sum(p[i].item() for i in keep)
    out = [0.0] * len(p)
    mass = 0.0
    for i in keep:
        if mass >= params.top_p:
            break
        out[i] = p[i].item() / total
        mass += out[i]
    norm = sum(out)
    return [v / norm for v in out]


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    n = sum(counts)
    support = [i for i, p in enumerate(probs) if p > 0]
    assert all(counts[i] == 0 for i in range(len(probs)) if probs[i] == 0), "a token outside the support"
    stat = sum((counts[i] - n * probs[i]) ** 2 / (n * probs[i]) for i in support)
    return stat, len(support) - 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, logit_bias={3: 1.5}),
], ids=["plain", "topk-topp-bias"])
def test_sampled_outputs_keep_their_distribution(params):
    torch.manual_seed(1234)
    vocab = 8
    logits = torch.randn(3, vocab) * 1.5
    probs = [reference_probs(logits[i], params) for i in range(3)]
    draft = [max(range(vocab), key=lambda t: probs[0][t] if t != probs[0].index(max(probs[0])) else -1),
             probs[1].index(max(probs[1]))]  # the second most likely first token, then the likeliest second
    sampler = Sampler()
    first, second = [0] * vocab, [0] * vocab
    draws = 6000
    for _ in range(draws):
        v = verify_draft(sampler, logits, params, "r", draft)
        tokens = [*draft[:v.num_accepted], v.token]
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1  # the second token given the first: row 1's distribution
    for counts, p in ((first, probs[0]), (second, probs[1])):
        stat, df = chi_square(counts, p)
        assert sum(counts) > 500 and stat < CHI2_999[df], (counts, p)
    assert math.isclose(first[draft[0]] / draws, probs[0][draft[0]], abs_tol=0.03)


def test_greedy_verification_keeps_the_draft_while_it_is_the_argmax():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 1, 5]):
        logits[row, best] = 3.0
    v = verify_draft(Sampler(), logits, SamplingParams(temperature=0.0, logprobs=1), "g", [2, 4, 3])
    assert (v.num_accepted, v.token) == (2, 1)
    assert [lp.token_id for lp in v.logprobs] == [2, 4, 1] and all(lp.top[0][0] == lp.token_id for lp in v.logprobs)
