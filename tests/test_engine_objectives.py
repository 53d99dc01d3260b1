"""Objectives in the engine (issue 33): the waiting queue by priority then deadline, the most urgent prefill first
with every decode still first, the lowest priority preempted first and queued at its own place, the budget capped
for a running request's tighter TPOT target, and goodput per objective on the daemon's metrics."""
from __future__ import annotations

import random

from prometheus_client import CollectorRegistry
from scheduler_driver import check_blocks_conserved, checked_step, make_request, make_scheduler

from stallfree.contracts import Profile, ProfilePoint, min_budget_for
from stallfree.node_daemon.engine.iteration_cost import OnlineIterationCost
from stallfree.node_daemon.engine.output_length import OutputLengthEstimate
from stallfree.node_daemon.engine.request import Objective, Request, RequestStatus
from stallfree.node_daemon.server.metrics import EngineMetrics, met_objective


def with_objective(request: Request, priority: int = 0, deadline: float | None = None,
                   tpot_ms: float | None = None, name: str = "chat") -> Request:
    request.objective = Objective(name, priority, deadline, tpot_ms)
    return request


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def layout(output) -> list[tuple[str, int, int, bool]]:
    return [(c.request.request_id, c.start, c.num_tokens, c.is_prefill) for c in output.chunks]


def test_the_waiting_queue_is_ordered_by_priority_then_deadline_then_arrival():
    s = make_scheduler(num_blocks=128, token_budget=64, max_num_seqs=1)
    s.add_request(make_request("plain", 4))  # no objective: priority 0, after every deadline of its band
    s.add_request(with_objective(make_request("p0-late", 4), 0, deadline=50.0))
    s.add_request(with_objective(make_request("p5-late", 4), 5, deadline=100.0))
    s.add_request(with_objective(make_request("p5-soon", 4), 5, deadline=10.0))
    s.add_request(with_objective(make_request("p5-none", 4), 5))
    s.add_request(with_objective(make_request("p0-soon", 4), 0, deadline=20.0))
    s.add_request(make_request("plain-2", 4))
    assert ids(s.waiting) == ["p5-soon", "p5-late", "p5-none", "p0-soon", "p0-late", "plain", "plain-2"]
    admitted = []
    while s.has_unfinished():
        output, _ = checked_step(s)
        admitted += [c.request.request_id for c in output.chunks if c.is_prefill]
    assert admitted == ["p5-soon", "p5-late", "p5-none", "p0-soon", "p0-late", "plain", "plain-2"]


def test_a_more_urgent_request_arriving_later_gets_its_prefill_chunk_first_and_every_decode_still_runs():
    s = make_scheduler(num_blocks=256, token_budget=48, max_num_seqs=8, max_partial_prefills=2, prefix_caching=False)
    s.add_request(make_request("d", 8, max_tokens=50))
    checked_step(s)  # "d" prefills whole and samples: now it decodes
    s.add_request(with_objective(make_request("batch", 200), priority=-1))
    output, _ = checked_step(s)
    assert layout(output) == [("d", 8, 1, False), ("batch", 0, 47, True)]
    s.add_request(with_objective(make_request("urgent", 30), priority=10, deadline=1.0))
    output, _ = checked_step(s)
    # The decode first as always, then the urgent newcomer; the batch prefill gets none of what is left, which would
    # only lengthen the iteration that carries the urgent prefill (its TTFT).
    assert layout(output) == [("d", 9, 1, False), ("urgent", 0, 30, True)]
    output, _ = checked_step(s)
    # Both decode before any prefill (the higher priority first: a KV shortfall then finds the lower unscheduled);
    # no urgent prefill left, so the batch prefill goes on in the rest of the budget.
    assert layout(output) == [("urgent", 30, 1, False), ("d", 10, 1, False), ("batch", 47, 46, True)]


def test_a_lower_priority_is_not_admitted_beside_a_higher_prioritys_prefill_but_its_own_band_is():
    s = make_scheduler(num_blocks=256, token_budget=64, max_num_seqs=8, max_partial_prefills=4, prefix_caching=False)
    s.add_request(with_objective(make_request("chat-1", 10), priority=5, deadline=1.0))
    s.add_request(with_objective(make_request("chat-2", 10), priority=5, deadline=2.0))
    s.add_request(with_objective(make_request("batch", 100), priority=-1))
    output, _ = checked_step(s)
    assert layout(output) == [("chat-1", 0, 10, True), ("chat-2", 0, 10, True)]
    assert ids(s.waiting) == ["batch"]
    output, _ = checked_step(s)  # no chat prefill left: the batch request takes the budget beside the decodes
    assert layout(output) == [("chat-1", 10, 1, False), ("chat-2", 10, 1, False), ("batch", 0, 62, True)]


def test_a_partial_prefill_goes_on_before_a_newcomer_of_the_same_urgency():
    s = make_scheduler(num_blocks=256, token_budget=48, max_num_seqs=8, max_partial_prefills=2, prefix_caching=False)
    s.add_request(with_objective(make_request("first", 100), priority=3))
    checked_step(s)
    s.add_request(with_objective(make_request("second", 100), priority=3))
    output, _ = checked_step(s)
    assert layout(output) == [("first", 48, 48, True)]


def test_the_partial_prefill_cap_counts_the_prefills_in_flight_of_the_same_priority_or_higher():
    s = make_scheduler(num_blocks=256, token_budget=48, max_num_seqs=8, max_partial_prefills=1, prefix_caching=False)
    s.add_request(with_objective(make_request("batch", 200), priority=-1))
    checked_step(s)
    s.add_request(with_objective(make_request("urgent", 100), priority=10))
    s.add_request(with_objective(make_request("urgent-2", 100), priority=10))
    output, _ = checked_step(s)
    # "batch" is still partial, but of a lower priority: it gets no chunk beside "urgent" and does not hold it back
    # under the cap (1). "urgent-2" would stay partial beside "urgent", of its own priority: the cap keeps it waiting.
    assert layout(output) == [("urgent", 0, 48, True)] and ids(s.waiting) == ["urgent-2"]
    later = [layout(checked_step(s)[0]) for _ in range(5)]
    assert later == [[("urgent", 48, 48, True)],
                     [("urgent", 96, 4, True), ("urgent-2", 0, 44, True)],  # its own band's cap: after "urgent"
                     [("urgent", 100, 1, False), ("urgent-2", 44, 47, True)],
                     [("urgent", 101, 1, False), ("urgent-2", 91, 9, True)],
                     # no urgent prompt left: "batch" goes on from where it stopped, its KV kept
                     [("urgent", 102, 1, False), ("urgent-2", 100, 1, False), ("batch", 48, 46, True)]]


def test_a_lower_priority_near_its_deadline_takes_the_leftover_budget_beside_a_higher_prefill():
    s = make_scheduler(num_blocks=256, token_budget=48, max_num_seqs=8, max_partial_prefills=1, prefix_caching=False)
    s.add_request(with_objective(make_request("batch", 200), priority=-1, deadline=10.0))  # arrived at 0.0
    checked_step(s, now=0.0)
    s.add_request(with_objective(make_request("urgent", 100), priority=10, deadline=20.0))
    output, _ = checked_step(s, now=4.0)  # 6 s of its 10 left: not due, paused beside the urgent prefill
    assert layout(output) == [("urgent", 0, 48, True)]
    output, _ = checked_step(s, now=5.5)  # under half of its time left: due, it takes what "urgent" leaves
    assert layout(output) == [("urgent", 48, 48, True)]  # nothing left over
    output, _ = checked_step(s, now=5.6)
    assert layout(output) == [("urgent", 96, 4, True), ("batch", 48, 44, True)]  # after it, never before


def test_a_waiting_lower_priority_near_its_deadline_is_admitted_in_the_leftover_budget():
    s = make_scheduler(num_blocks=256, token_budget=48, max_num_seqs=8, max_partial_prefills=2, prefix_caching=False)
    s.add_request(with_objective(make_request("urgent", 30), priority=10, deadline=20.0))
    s.add_request(with_objective(make_request("batch", 40), priority=-1, deadline=10.0))  # arrived at 0.0
    output, _ = checked_step(s, now=1.0)
    assert layout(output) == [("urgent", 0, 30, True)] and ids(s.waiting) == ["batch"]
    s.add_request(with_objective(make_request("urgent-2", 30), priority=10, deadline=20.0))
    output, _ = checked_step(s, now=6.0)  # due: admitted after the urgent prefill, in what it leaves
    assert layout(output) == [("urgent", 30, 1, False), ("urgent-2", 0, 30, True), ("batch", 0, 17, True)]


def _until_preempted(s, max_steps: int = 50):
    for _ in range(max_steps):
        output, _ = checked_step(s)
        if output.preempted:
            return output
    raise AssertionError("no preemption")


def test_under_kv_pressure_the_lowest_priority_is_preempted_first_and_keeps_its_place():
    # Reserving no output tokens admits every prompt; decoding then runs out of blocks.
    s = make_scheduler(num_blocks=10, block_size=4, token_budget=64, max_num_seqs=3,
                       output_estimate=OutputLengthEstimate.fixed(0))
    s.add_request(with_objective(make_request("low", 6, max_tokens=12), priority=-1, name="batch"))
    checked_step(s)  # admitted first: the old rule (latest admitted) would never pick it
    s.add_request(make_request("a", 6, max_tokens=12))
    s.add_request(make_request("b", 6, max_tokens=12))
    checked_step(s)
    # Of the same band as "low": it waits for a slot, it preempts nobody.
    s.add_request(with_objective(make_request("late-low", 6, max_tokens=2), priority=-1, name="batch"))
    assert s.num_running == 3 and ids(s.waiting) == ["late-low"]
    output = _until_preempted(s)
    assert ids(output.preempted) == ["low"]
    assert {c.request.request_id for c in output.chunks} == {"a", "b"}  # the others still decode
    # Back by its own priority and original arrival: ahead of a later request of its band.
    assert ids(s.waiting) == ["low", "late-low"]
    assert s.get_request("low").status is RequestStatus.PREEMPTED
    check_blocks_conserved(s)
    while s.has_unfinished():
        checked_step(s)


def test_a_higher_priority_request_preempts_the_lowest_running_one_when_the_running_set_is_full():
    s = make_scheduler(num_blocks=64, block_size=4, token_budget=64, max_num_seqs=3)
    s.add_request(with_objective(make_request("low", 6, max_tokens=12), priority=-1, name="batch"))
    checked_step(s)
    s.add_request(make_request("a", 6, max_tokens=12))
    s.add_request(make_request("b", 6, max_tokens=12))
    checked_step(s)
    s.add_request(with_objective(make_request("late-low", 6, max_tokens=2), priority=-1, name="batch"))
    checked_step(s)
    assert s.num_running == 3 and ids(s.waiting) == ["late-low"]  # an equal priority preempts nobody
    s.add_request(with_objective(make_request("vip", 6, max_tokens=2), priority=9))
    output, _ = checked_step(s)
    # "low" goes (recompute); the survivors' decodes first, then the newcomer's prefill in the same iteration.
    assert ids(output.preempted) == ["low"]
    assert [(c.request.request_id, c.is_prefill) for c in output.chunks] == [("a", False), ("b", False),
                                                                              ("vip", True)]
    assert ids(s.waiting) == ["low", "late-low"]  # the victim keeps its place: ahead of the later one of its band
    assert s.get_request("low").status is RequestStatus.PREEMPTED and s.get_request("low").num_computed_tokens == 0
    check_blocks_conserved(s)
    while s.has_unfinished():
        checked_step(s)
    assert s.get_request("low") is None  # it resumed and finished


def test_a_higher_priority_request_never_preempts_an_equal_or_higher_one():
    s = make_scheduler(num_blocks=64, block_size=4, token_budget=64, max_num_seqs=2)
    s.add_request(with_objective(make_request("top", 6, max_tokens=12), priority=9))
    s.add_request(with_objective(make_request("mid", 6, max_tokens=12), priority=5))
    checked_step(s)
    s.add_request(with_objective(make_request("mid-2", 6, max_tokens=2), priority=5))
    output, _ = checked_step(s)
    assert not output.preempted and ids(s.waiting) == ["mid-2"]


def test_a_preempted_request_without_objective_resumes_ahead_of_later_ones_as_before():
    s = make_scheduler(num_blocks=10, block_size=4, token_budget=64, max_num_seqs=3,
                       output_estimate=OutputLengthEstimate.fixed(0))
    for i in range(3):
        s.add_request(make_request(f"r{i}", 6, max_tokens=12))
    s.add_request(make_request("later", 6, max_tokens=2))
    output = _until_preempted(s)
    assert ids(output.preempted) == ["r2"] and ids(s.waiting) == ["r2", "later"]


class BudgetPerMs:
    """A TPOT budget model: one token per ms of target."""

    def budget_for_tpot(self, tpot_ms: float) -> int:
        return int(tpot_ms)


def test_the_budget_follows_the_tightest_tpot_target_among_running_requests_when_tighter_than_the_services():
    s = make_scheduler(num_blocks=256, token_budget=200, max_num_seqs=8, prefix_caching=False)
    s.set_tpot_budget(BudgetPerMs(), service_tpot_ms=150.0)
    s.add_request(with_objective(make_request("loose", 8, max_tokens=40), tpot_ms=300.0))
    output, _ = checked_step(s)
    assert output.token_budget == 200  # not yet running when the iteration was planned
    output, _ = checked_step(s)
    assert output.token_budget == 200  # looser than the service's target: the service's budget holds
    s.add_request(with_objective(make_request("tight", 8, max_tokens=40), tpot_ms=90.0))
    checked_step(s)  # admitted
    s.add_request(make_request("long", 200))
    output, _ = checked_step(s)
    assert output.token_budget == 90 and output.num_tokens <= 90
    assert {c.request.request_id for c in output.chunks if not c.is_prefill} == {"loose", "tight"}  # decodes all run
    s.abort_request("tight")
    output, _ = checked_step(s)
    assert output.token_budget == 200


def test_the_tpot_cap_never_takes_the_room_the_running_decodes_need():
    s = make_scheduler(num_blocks=256, token_budget=200, max_num_seqs=8, prefix_caching=False)
    s.set_tpot_budget(BudgetPerMs(), service_tpot_ms=None)  # no service target: any request target counts
    for i in range(3):
        s.add_request(with_objective(make_request(f"t{i}", 8, max_tokens=40), tpot_ms=1.0))
    checked_step(s)
    output, _ = checked_step(s)
    assert output.token_budget == min_budget_for(3)


def test_the_iteration_cost_models_budget_for_a_tpot_target_is_the_start_ups_rule_at_the_fitted_speed():
    mixed = [ProfilePoint(tokens=t, num_decodes=4, iteration_ms=20 + 0.5 * t) for t in (64, 128, 256, 512)]
    decode = [ProfilePoint(tokens=b, num_decodes=b, iteration_ms=20 + 1.0 * b) for b in (1, 4, 16)]
    cost = OnlineIterationCost(Profile(device="cpu", decode_only=decode, mixed=mixed))
    assert cost.budget_for_tpot(200.0) == 256  # 148 ms fits 0.8 x 200 ms, 276 ms does not
    cost.coefficients = (2.0, 0.0, 0.0)  # the machine runs twice as slow as its profile
    assert cost.budget_for_tpot(200.0) == 64


def test_mixed_objectives_under_kv_pressure_keep_every_invariant_and_finish():
    rng = random.Random(33)
    preemptions = 0
    for trial in range(20):
        s = make_scheduler(num_blocks=24, block_size=4, token_budget=64, max_num_seqs=4, max_partial_prefills=2,
                           long_prefill_threshold=rng.choice((0, 8)), output_estimate=OutputLengthEstimate.fixed(0))
        s.set_tpot_budget(BudgetPerMs(), service_tpot_ms=100.0)
        pending = []
        for i in range(12):
            request = make_request(f"t{trial}-{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 20))
            if rng.random() < 0.7:
                with_objective(request, rng.choice((-1, 0, 5)), rng.choice((None, rng.uniform(0, 10))),
                               rng.choice((None, 10.0, 60.0, 500.0)))
            pending.append(request)
        finished = []
        for _ in range(2000):
            if pending and rng.random() < 0.4:
                s.add_request(pending.pop(0))
            if not pending and not s.has_unfinished():
                break
            output, done = checked_step(s)
            finished += done
            assert output.num_tokens <= output.token_budget
            assert [c.is_prefill for c in output.chunks] == sorted(c.is_prefill for c in output.chunks)  # decodes first
            keys = [(r.urgency, r.arrival_seq) for r in s.waiting]
            assert keys == sorted(keys)
        assert len(finished) == 12 and s._num_objectives == 0 and s._num_tpot_targets == 0
        preemptions += s.num_preemptions
    assert preemptions  # KV pressure was real


# ---- goodput on the daemon's metrics --------------------------------------------------------------------

def _finished(objective: Objective | None, first_token: float, last_token: float, outputs: int,
              status: RequestStatus = RequestStatus.FINISHED_LENGTH) -> Request:
    request = make_request("r", 4, max_tokens=outputs)
    request.objective = objective
    request.arrival_time = 0.0
    for _ in range(outputs):
        request.append_output_token(7)
    request.first_token_time, request.last_token_time, request.status = first_token, last_token, status
    return request


def test_a_request_meets_its_objective_when_it_is_served_by_its_deadline_within_its_tpot_target():
    chat = Objective("chat", 5, deadline=1.0, tpot_target_ms=50.0)
    assert met_objective(_finished(chat, 0.9, 0.9 + 9 * 0.04, 10))
    assert not met_objective(_finished(chat, 1.1, 1.1 + 9 * 0.04, 10))  # first token after the deadline
    assert not met_objective(_finished(chat, 0.9, 0.9 + 9 * 0.06, 10))  # mean TPOT over the target
    assert not met_objective(_finished(chat, 0.5, 0.6, 10, RequestStatus.FINISHED_ABORTED))
    assert met_objective(_finished(None, 100.0, 200.0, 10))  # no objective, nothing to miss
    assert met_objective(_finished(Objective("batch", -1), 100.0, 200.0, 10))


def _sample(metrics: EngineMetrics, name: str, objective: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", "objective": objective})
    return 0.0 if value is None else value


def test_goodput_counters_per_objective_move_on_the_daemons_metrics():
    metrics = EngineMetrics("m", CollectorRegistry())
    chat = Objective("chat", 5, deadline=1.0, tpot_target_ms=50.0)
    metrics.on_finished(_finished(chat, 0.9, 1.0, 3), 2.0)
    metrics.on_finished(_finished(chat, 1.5, 1.6, 3), 2.0)
    metrics.on_finished(_finished(None, 0.5, 0.6, 3), 2.0)
    metrics.on_finished(_finished(None, 0.5, 0.6, 3, RequestStatus.FINISHED_ERROR), 2.0)
    assert _sample(metrics, "stallfree_objective_finished_requests_total", "chat") == 2.0
    assert _sample(metrics, "stallfree_objective_goodput_requests_total", "chat") == 1.0
    assert _sample(metrics, "stallfree_objective_finished_requests_total", "default") == 2.0
    assert _sample(metrics, "stallfree_objective_goodput_requests_total", "default") == 1.0
