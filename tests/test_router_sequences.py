"""`n` weighs as n sequences: a request of 64 choices holds 64 running slots on its replica, in the router's pick
and flow control, so two of them do not stack 128 sequences on one replica while another idles."""
from __future__ import annotations

from stallfree.operator.router.flow_control import FlowConfig, FlowQueue, Queued
from stallfree.operator.router.pick import Choice, ReplicaView
from stallfree.operator.router.replicas import Replica
from stallfree.operator.router.requests import read_parsed
from stallfree.operator.router.waiting_room import WaitingRoom


def test_the_router_reads_n_as_the_sequences_a_request_runs():
    assert read_parsed({"prompt": "hi", "n": 64}, 4.0).sequences == 64
    for n in (None, "64", True, 0, 10_000):
        assert read_parsed({"prompt": "hi", "n": n}, 4.0).sequences == 1  # the replica judges what is malformed


def _view(name: str, outstanding: int = 0) -> ReplicaView:
    return ReplicaView(name, queued_prefill_tokens=0, prefill_tokens_per_ms=1.0, step_ms=10.0,
                       outstanding=outstanding, max_num_seqs=64)


def test_two_requests_of_64_choices_go_to_two_replicas_even_with_affinity_for_one():
    queue: FlowQueue[int] = FlowQueue(FlowConfig())
    for key in (1, 2):
        assert queue.push(Queued(key, 0.0, 10, sequences=64))

    def affinity_for_a(item, candidates) -> Choice:  # the same prompt: its cached prefix is on `a`
        names = [v.name for v in candidates]
        return Choice("a" if "a" in names else names[0], 10.0, "affinity")

    sent = queue.dispatch([_view("a"), _view("b")], affinity_for_a)
    assert [(item.key, choice.name) for item, choice in sent] == [(1, "a"), (2, "b")]
    # An idle replica still takes a request of more choices than its running set holds (it would wait forever).
    queue.push(Queued(3, 0.0, 10, sequences=100))
    assert [c.name for _, c in queue.dispatch([_view("a", 64), _view("b")], affinity_for_a)] == ["b"]


def test_a_reservation_holds_n_slots_until_it_is_released():
    room: WaitingRoom[int] = WaitingRoom(FlowConfig())
    replica = Replica("r0", url="virtual://r0", healthy=True, reason="ready")
    ticket = room.reserve(replica, 10, 0.0, priority=3, sequences=64)
    view = replica.view(0.0)
    assert view.outstanding == 64 and view.outstanding_by_priority == {3: 64}  # no stats: no max_num_seqs yet
    room.release(replica, ticket, 1.0)
    assert replica.view(1.0).outstanding == 0
