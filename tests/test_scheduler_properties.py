"""Property tests: random arrivals, lengths, budgets, live limit changes and aborts against the scheduler's rules.

Each example draws a KV cache, a policy's limits and a program of steps; before and after every step it
checks the invariants the engine and the operator rely on, then drains everything and checks that no
request was lost and every KV block came back.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_driver import EOS, check_blocks_conserved, is_decode, make_request, sample_tokens, shadow_for

from stallfree.contracts import Ceilings, Tuning, min_budget_for
from stallfree.node_daemon.engine.config import SchedulerConfig
from stallfree.node_daemon.engine.kv_cache_manager import KVCacheManager
from stallfree.node_daemon.engine.output_length import OutputLengthEstimate
from stallfree.node_daemon.engine.request import Request, RequestStatus
from stallfree.node_daemon.engine.request_rules import InvalidRequest, RequestLimits, check_request
from stallfree.node_daemon.engine.scheduler import Scheduler
from stallfree.simulator.baseline_schedulers import PolicyConfig, build_scheduler

CEILINGS = Ceilings(max_token_budget=160, max_num_seqs=12)
MAX_MODEL_LEN = 96
PREFIXES = [[], [11, 12, 13, 14, 15, 16, 17, 18, 19], [11, 12, 13, 14, 30, 31, 32, 33, 34, 35, 36, 37]]
# STALLFREE_PROPERTY_EXAMPLES=2000 for a deep run; the default keeps the suite fast.
EXAMPLES = int(os.environ.get("STALLFREE_PROPERTY_EXAMPLES", "120"))
PROPERTY_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tunings(draw) -> Tuning:
    max_num_seqs = draw(st.integers(1, CEILINGS.max_num_seqs))
    budget = draw(st.integers(min_budget_for(max_num_seqs), CEILINGS.max_token_budget))
    return Tuning(token_budget=budget, max_num_seqs=max_num_seqs, max_partial_prefills=draw(st.integers(1, 3)),
                  long_prefill_threshold=draw(st.sampled_from([0, 0, 1, 5, 16, 40])))


@st.composite
def requests(draw, request_id: str) -> Request:
    prefix = draw(st.sampled_from(PREFIXES))
    suffix = draw(st.lists(st.integers(20, 29), min_size=0 if prefix else 1, max_size=50))
    request = make_request(request_id, prefix + suffix, max_tokens=draw(st.integers(1, 24)),
                           ignore_eos=draw(st.booleans()), stop_token_ids=draw(st.sampled_from([[], [3]])))
    return request


@dataclass
class Ledger:
    """What the test saw: arrivals in order, first admissions, and how each request ended."""

    arrived: list[str] = field(default_factory=list)
    admitted: set[str] = field(default_factory=set)
    finished: dict[str, Request] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    partial_cap_lowered: bool = False


def checked_step(s: Scheduler, ledger: Ledger, data) -> None:
    """One iteration with every per-step invariant checked."""
    tuning = s.tuning
    stall_free = type(s) is Scheduler  # the daemon's policy (the baselines keep fewer of these promises)
    decodes_before = [r for r in s.running if is_decode(r)]
    partial_before = len(s.running) - len(decodes_before)

    output = s.schedule()
    scheduled = {c.request.request_id: c for c in output.chunks}
    preempted = {r.request_id for r in output.preempted}
    assert len(scheduled) == len(output.chunks), "a request scheduled twice in one iteration"
    assert output.num_tokens == sum(c.num_tokens for c in output.chunks)
    assert output.num_decode_tokens == sum(1 for c in output.chunks if not c.is_prefill)
    assert len(s.running) <= tuning.max_num_seqs
    assert not preempted & set(scheduled)
    for r in output.preempted:
        assert r.status is RequestStatus.PREEMPTED and not r.block_ids
        assert s.waiting[0].status is RequestStatus.PREEMPTED

    for chunk in output.chunks:
        request = chunk.request
        end = chunk.start + chunk.num_tokens
        assert chunk.num_tokens >= 1 and end <= request.num_tokens
        assert chunk.samples == (end == request.num_tokens)  # the last token is always computed
        assert chunk.start == request.num_computed_tokens
        if request.request_id not in ledger.admitted:
            # FCFS: everything that arrived before it was admitted already or aborted.
            position = ledger.arrived.index(request.request_id)
            for earlier in ledger.arrived[:position]:
                assert earlier in ledger.admitted or earlier in ledger.aborted, f"{request.request_id} passed {earlier}"
            ledger.admitted.add(request.request_id)
        if chunk.is_prefill and request.num_computed_tokens == request.num_cached_tokens:
            assert chunk.start % s.kv_cache.block_size == 0 and chunk.start < request.num_tokens
    if stall_free:
        assert output.num_tokens <= tuning.token_budget
        for request in decodes_before:
            assert request.request_id in scheduled or request.request_id in preempted, "a running decode stalled"
        if tuning.long_prefill_threshold:
            assert all(c.num_tokens <= tuning.long_prefill_threshold for c in output.chunks if c.is_prefill)
        partial_now = sum(
            1 for r in s.running
            if (scheduled[r.request_id].start + scheduled[r.request_id].num_tokens if r.request_id in scheduled
                else r.num_computed_tokens) < r.num_tokens
        )
        assert s.num_partial_prefills == partial_now
        assert partial_now <= max(tuning.max_partial_prefills, partial_before)
        if not ledger.partial_cap_lowered:
            assert partial_now <= tuning.max_partial_prefills

    shadow_for(s).check_and_write(output)
    token = data.draw(st.sampled_from([7, 8, 9, EOS, 3]), label="token") if data else 7
    for request in s.update_from_output(output, sample_tokens(output, lambda r: token)):
        assert request.request_id not in ledger.finished
        ledger.finished[request.request_id] = request
    check_blocks_conserved(s)


def check_finished(request: Request) -> None:
    sampling = request.sampling
    assert not request.block_ids and 1 <= len(request.output_token_ids) <= sampling.max_tokens
    last = request.output_token_ids[-1]
    if request.status is RequestStatus.FINISHED_STOPPED:
        assert (last == EOS and not sampling.ignore_eos) or last in sampling.stop_token_ids
    else:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert len(request.output_token_ids) == sampling.max_tokens or request.num_tokens >= MAX_MODEL_LEN


def make(policy: str, data) -> Scheduler:
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]), label="block_size")
    num_blocks = data.draw(st.integers(-(-(MAX_MODEL_LEN // 2) // block_size), 160 // block_size), label="num_blocks")
    config = PolicyConfig(ceilings=CEILINGS, tuning=data.draw(tunings(), label="tuning"),
                          watermark_blocks=data.draw(st.integers(0, 3), label="watermark"),
                          max_model_len=MAX_MODEL_LEN, policy=policy)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=data.draw(st.booleans(), label="caching"))
    estimates = [OutputLengthEstimate.worst_case(), OutputLengthEstimate(initial=4, floor=2),
                 OutputLengthEstimate.fixed(0)]
    scheduler = build_scheduler(config, kv)
    scheduler.output_estimate = data.draw(st.sampled_from(estimates), label="reservation")
    return scheduler


def run_program(s: Scheduler, data, num_steps: int) -> Ledger:
    ledger = Ledger()
    in_flight: list[str] = []
    for step in range(num_steps):
        for _ in range(data.draw(st.integers(0, 3), label="arrivals")):
            request = data.draw(requests(f"s{step}-{len(ledger.arrived)}"), label="request")
            # The engine checks a request before the scheduler sees it (request_rules); the scheduler only asserts.
            limits = RequestLimits(min(request.max_model_len, s.config.max_model_len), None, s.kv_cache.num_blocks,
                                   s.kv_cache.block_size)
            try:
                check_request(request.num_prompt_tokens, request.sampling, limits)
            except InvalidRequest:
                continue
            s.add_request(request)
            ledger.arrived.append(request.request_id)
            in_flight.append(request.request_id)
        action = data.draw(st.sampled_from(["step", "step", "step", "abort", "tune"]), label="action")
        if action == "abort" and in_flight:
            victim = data.draw(st.sampled_from(in_flight), label="abort")
            aborted = s.abort_request(victim)
            if aborted is not None:
                assert aborted.status is RequestStatus.FINISHED_ABORTED and not aborted.block_ids
                ledger.aborted.add(victim)
            else:
                assert victim in ledger.finished
        elif action == "tune":
            tuning = data.draw(tunings(), label="new tuning")
            if tuning.max_partial_prefills < s.tuning.max_partial_prefills:
                ledger.partial_cap_lowered = True
            s.set_tuning(tuning)
        checked_step(s, ledger, data)
        in_flight = [r for r in in_flight if s.get_request(r) is not None]
    return ledger


def drain(s: Scheduler, ledger: Ledger, data) -> None:
    for _ in range(3000):
        if not s.has_unfinished():
            break
        checked_step(s, ledger, data)
    assert not s.has_unfinished(), "requests left over: no progress"
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.kv_cache.num_used_blocks == 0 and s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
    assert set(ledger.arrived) == set(ledger.finished) | ledger.aborted, "a request was lost"
    assert not set(ledger.finished) & ledger.aborted
    for request in ledger.finished.values():
        check_finished(request)


@PROPERTY_SETTINGS
@given(st.data())
def test_stall_free_invariants_under_random_load_aborts_and_live_tuning(data):
    s = make("stall_free", data)
    ledger = run_program(s, data, num_steps=data.draw(st.integers(1, 40), label="steps"))
    drain(s, ledger, data)


@settings(max_examples=max(1, EXAMPLES // 3), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(["prefill_priority", "decode_priority"]))
def test_baseline_policies_serve_everything_and_conserve_blocks(data, policy):
    s = make(policy, data)
    ledger = run_program(s, data, num_steps=data.draw(st.integers(1, 25), label="steps"))
    drain(s, ledger, data)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 24))
def test_identical_prompts_hit_the_prefix_cache_and_still_compute_their_last_token(lengths, max_tokens):
    s = Scheduler(SchedulerConfig(ceilings=CEILINGS, tuning=Tuning(token_budget=64, max_num_seqs=4),
                                  max_model_len=MAX_MODEL_LEN), KVCacheManager(256, 4))
    ledger = Ledger()
    base = [40 + i % 9 for i in range(max(lengths))]
    for i, n in enumerate(lengths):
        request = make_request(f"r{i}", base[:n], max_tokens=max_tokens)
        s.add_request(request)
        ledger.arrived.append(request.request_id)
        drain(s, ledger, None)  # one at a time: each later prompt finds the earlier ones' blocks
        longest_before = max([0] + lengths[:i])
        expected = min(longest_before, n - 1) // 4 * 4
        assert request.num_cached_tokens >= expected
