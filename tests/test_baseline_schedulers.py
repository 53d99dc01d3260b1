"""The simulator's baseline schedulers (simulator/baseline_schedulers.py): the time target, prefill- and decode-priority."""
from __future__ import annotations

import pytest
from scheduler_driver import checked_step, make_baseline, make_request, run_to_completion

from stallfree.node_daemon.engine.scheduler import Scheduler
from stallfree.simulator.baseline_schedulers import (POLICIES, DecodePriorityScheduler, PolicyConfig,
                                                     PrefillPriorityScheduler, TimeTargetScheduler)


def step(scheduler, token: int = 7):
    return checked_step(scheduler, lambda request: token)


def layout(output) -> list[tuple[str, int, int, bool]]:
    return [(c.request.request_id, c.start, c.num_tokens, c.is_prefill) for c in output.chunks]


def test_each_policy_builds_its_scheduler_and_an_unknown_one_is_refused():
    assert type(make_baseline("prefill_priority")) is PrefillPriorityScheduler
    assert type(make_baseline("decode_priority")) is DecodePriorityScheduler
    assert type(make_baseline("stall_free", iteration_time_target_ms=5.0, cost_model=LinearCost(1, 1))) is TimeTargetScheduler
    # Without a cost model a time target cannot be predicted: the daemon's scheduler, as before.
    assert type(make_baseline("stall_free", iteration_time_target_ms=5.0)) is Scheduler
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        PolicyConfig(policy="round_robin")


# ---- the iteration-time target -----------------------------------------------------------------------

class LinearCost:
    """A straight-line cost model: fixed overhead plus a cost per token (decodes and chunks alike)."""

    def __init__(self, fixed_ms: float, per_token_ms: float) -> None:
        self.fixed_ms, self.per_token_ms = fixed_ms, per_token_ms
        self.calls = 0

    def predict_ms(self, decode_context_lens, prefill_chunks) -> float:
        self.calls += 1
        tokens = len(decode_context_lens) + sum(n for _, n in prefill_chunks)
        return self.fixed_ms + self.per_token_ms * tokens


def test_time_target_cuts_the_chunk_to_the_largest_size_that_fits():
    cost = LinearCost(fixed_ms=2.0, per_token_ms=0.1)
    s = make_baseline(num_blocks=128, token_budget=200, max_num_seqs=8, iteration_time_target_ms=5.0,
                      cost_model=cost)
    s.add_request(make_request("d", 4, max_tokens=50))
    step(s)
    s.add_request(make_request("long", 250))
    output, _ = step(s)
    # 2 ms + 0.1 ms x (1 decode + n) <= 5 ms  ->  n = 29
    assert layout(output) == [("d", 4, 1, False), ("long", 0, 29, True)]
    assert cost.calls > 2  # found by bisection


def test_time_target_below_the_overhead_still_makes_progress():
    s = make_baseline(num_blocks=64, iteration_time_target_ms=1.0, cost_model=LinearCost(5.0, 0.1))
    s.add_request(make_request("a", 6, max_tokens=2))
    output, _ = step(s)
    assert layout(output) == [("a", 0, 1, True)]
    assert len(run_to_completion(s)) == 1


# ---- baseline policies -------------------------------------------------------------------------------

def test_prefill_priority_runs_whole_prompts_first_and_pauses_decodes():
    s = make_baseline("prefill_priority", num_blocks=256, token_budget=40, max_num_seqs=8)
    s.add_request(make_request("d", 4, max_tokens=20))
    step(s)
    s.add_request(make_request("long", 200))  # whole, though far above the live budget
    output, _ = step(s)
    assert layout(output) == [("long", 0, 200, True)]
    output, _ = step(s)
    assert layout(output) == [("d", 4, 1, False), ("long", 200, 1, False)]  # "d" lost a step to the prompt


def test_decode_priority_admits_only_when_nothing_runs():
    s = make_baseline("decode_priority", num_blocks=256, token_budget=40, max_num_seqs=8)
    s.add_request(make_request("a", 4, max_tokens=3))
    output, _ = step(s)
    assert layout(output) == [("a", 0, 4, True)]
    s.add_request(make_request("b", 4, max_tokens=3))
    output, _ = step(s)
    assert layout(output) == [("a", 4, 1, False)]
    output, finished = step(s)
    assert [r.request_id for r in finished] == ["a"]
    output, _ = step(s)
    assert layout(output) == [("b", 0, 4, True)]


def test_every_policy_serves_everything():
    for policy in POLICIES:
        s = make_baseline(policy, num_blocks=64, token_budget=48, max_num_seqs=4)
        for i in range(10):
            s.add_request(make_request(f"r{i}", 5 + 7 * i, max_tokens=1 + i % 4))
        finished = run_to_completion(s)
        assert len(finished) == 10, policy
        assert s.kv_cache.num_used_blocks == 0
