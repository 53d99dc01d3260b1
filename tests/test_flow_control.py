"""The router's flow control (operator/router/flow_control.py): pure dispatch rules."""
from __future__ import annotations

from stallfree.operator.router.flow_control import FlowConfig, FlowQueue, Queued, admits, dispatch_wait_ms
from stallfree.operator.router.pick import Choice, ReplicaView, pick_slo_aware


def view(name: str, queued: int = 0, rate: float = 1.0, outstanding: int = 0, seqs: int | None = 8) -> ReplicaView:
    return ReplicaView(name, queued_prefill_tokens=queued, prefill_tokens_per_ms=rate, step_ms=10.0,
                       outstanding=outstanding, max_num_seqs=seqs)


def first(item, candidates) -> Choice:
    """The router's own policy: the lowest predicted TTFT, backlog included."""
    return pick_slo_aware(candidates, item.prompt_tokens)


def test_a_replica_admits_while_its_queued_prefill_drains_within_the_share_of_the_slo():
    config = FlowConfig(dispatch_wait_ms=dispatch_wait_ms(2000.0))  # 25% of 2 s: 500 ms
    assert admits(view("a", queued=499, rate=1.0), config)
    assert not admits(view("a", queued=501, rate=1.0), config)
    assert admits(view("a", queued=0), config)  # idle: always


def test_a_full_running_set_admits_nothing():
    config = FlowConfig()
    assert not admits(view("a", outstanding=8, seqs=8), config)
    assert admits(view("a", outstanding=7, seqs=8), config)


def test_requests_wait_in_arrival_order_and_a_ready_replica_takes_the_oldest():
    queue: FlowQueue[int] = FlowQueue(FlowConfig(dispatch_wait_ms=100.0))
    for key in range(3):
        assert queue.push(Queued(key, float(key), 200))
    # The only replica is busy past the wait: nothing goes, nothing is lost.
    assert queue.dispatch([view("a", queued=1000)], first) == []
    assert len(queue) == 3
    # A new replica becomes ready: it takes from the shared queue at once, oldest first, and stops
    # once its own queued prefill passes the wait (200 ms of work each at 1 token/ms: one only).
    sent = queue.dispatch([view("a", queued=1000), view("b")], first)
    assert [item.key for item, _ in sent] == [0]
    assert [choice.name for _, choice in sent] == ["b"]
    assert [q.key for q in queue] == [1, 2]


def test_the_head_of_the_queue_is_never_overtaken():
    queue: FlowQueue[int] = FlowQueue(FlowConfig(dispatch_wait_ms=100.0))
    queue.push(Queued(0, 0.0, 5000))
    queue.push(Queued(1, 1.0, 10))
    sent = queue.dispatch([view("a", queued=50, rate=1.0, outstanding=7, seqs=8)], first)
    assert [item.key for item, _ in sent] == [0]  # admitted on wait; then the slot cap stops the next
    assert [q.key for q in queue] == [1]


def test_a_long_prompt_waits_for_the_fast_replica_and_a_short_one_behind_it_takes_the_free_slow_one():
    queue: FlowQueue[int] = FlowQueue(FlowConfig(dispatch_wait_ms=100.0))
    queue.push(Queued(0, 0.0, 8000))
    queue.push(Queued(1, 1.0, 50))
    slow_idle = view("slow", queued=0, rate=1.0)
    fast_busy = view("fast", queued=800, rate=4.0)  # 200 ms ahead: it does not admit now
    # On the idle slow replica the long prompt would take 8 s; behind the fast one's backlog, 2.2 s.
    sent = queue.dispatch([fast_busy, slow_idle], first)
    assert [(item.key, choice.name) for item, choice in sent] == [(1, "slow")]
    assert [q.key for q in queue] == [0]  # waits for the fast replica, first in line for it
    sent = queue.dispatch([view("fast", queued=200, rate=4.0), view("slow", queued=50, rate=1.0)], first)
    assert [(item.key, choice.name) for item, choice in sent] == [(0, "fast")]


def test_the_queue_is_bounded_and_a_leaving_client_is_removed():
    queue: FlowQueue[int] = FlowQueue(FlowConfig(max_queued=2))
    assert queue.push(Queued(0, 0.0, 1)) and queue.push(Queued(1, 0.0, 1))
    assert not queue.push(Queued(2, 0.0, 1))
    assert queue.rejected == 1 and queue.arrivals == 2  # a refused request is no arrival (no demand)
    assert queue.cancel(0) and not queue.cancel(0)
    assert queue.cancelled == 1 and [q.key for q in queue] == [1]
    assert queue.queued_prompt_tokens == 1


def test_a_retry_keeps_its_place_and_prefers_another_replica():
    queue: FlowQueue[int] = FlowQueue(FlowConfig(max_queued=1))
    queue.push(Queued(0, 0.0, 1))
    assert queue.push(Queued(9, -1.0, 1, exclude=frozenset({"a"})), front=True)  # past the bound: it was accepted
    sent = queue.dispatch([view("a"), view("b")], first)
    assert [(item.key, choice.name) for item, choice in sent] == [(9, "b"), (0, "a")]


def test_a_request_does_not_wait_for_a_replica_predicted_only_a_little_sooner():
    # Two equal replicas whose rate estimates differ: by them the busy one finishes a little sooner than the
    # idle one starts and finishes. Waiting for it would leave the idle replica idle: the idle one takes it.
    queue: FlowQueue[int] = FlowQueue(FlowConfig(dispatch_wait_ms=500.0))
    queue.push(Queued(0, 0.0, 3000))
    busy = view("busy", queued=2100, rate=3.9)  # 538 ms ahead: not admitting; predicted (2100+3000)/3.9 = 1308 ms
    idle = view("idle", queued=0, rate=2.2)  # predicted 3000/2.2 = 1364 ms: within 25% of it
    sent = queue.dispatch([busy, idle], first)
    assert [(item.key, choice.name) for item, choice in sent] == [(0, "idle")]
