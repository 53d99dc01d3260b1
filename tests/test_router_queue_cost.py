"""A request's cost in the router's queue does not grow with the queue: with every replica full a dispatch does not
walk the waiting requests, the gauges read per arrival are kept counts, and a 429 queue_full says when the queue
there is now will have drained."""
from __future__ import annotations

import json

import pytest

from stallfree.operator.router.answers import queue_full_answer
from stallfree.operator.router.flow_control import FlowConfig, FlowQueue, Queued
from stallfree.operator.router.objectives import Objective
from stallfree.operator.router.pick import Choice, ReplicaView
from stallfree.operator.router.waiting_room import QueueFull, WaitingRoom


def _view(name: str, outstanding: int, queued: int = 0) -> ReplicaView:
    return ReplicaView(name, queued_prefill_tokens=queued, prefill_tokens_per_ms=1.0, step_ms=10.0,
                       outstanding=outstanding, max_num_seqs=4)


def test_with_every_replica_full_a_dispatch_does_not_walk_the_queue(monkeypatch):
    queue: FlowQueue[int] = FlowQueue(FlowConfig(max_queued=10_000))
    for key in range(5_000):
        queue.push(Queued(key, 0.0, 10, priority=key % 3, tenant=f"t{key % 7}"))

    def walked():
        raise AssertionError("the queue was walked with no replica able to start anything")

    monkeypatch.setattr(queue, "ordered", walked)
    assert queue.dispatch([_view("a", 4), _view("b", 4)], lambda item, views: Choice(views[0].name, 0.0, "x")) == []
    monkeypatch.undo()
    sent = queue.dispatch([_view("a", 3), _view("b", 4)], lambda item, views: Choice(views[0].name, 0.0, "x"))
    assert len(sent) == 1 and sent[0][0].priority == 2  # a slot frees: the highest band's oldest goes


def test_the_queues_gauges_are_kept_counts():
    queue: FlowQueue[int] = FlowQueue(FlowConfig())
    for key, objective in enumerate(["chat", "chat", "batch"]):
        queue.push(Queued(key, 0.0, 100 + key, objective=objective))
    assert queue.queued_prompt_tokens == 303 and queue.depth_by_objective() == {"chat": 2, "batch": 1}
    queue.cancel(0)
    queue.dispatch([_view("a", 0)], lambda item, views: Choice("a", 0.0, "x"))
    assert queue.queued_prompt_tokens == 0 and queue.depth_by_objective() == {}


def test_a_full_queue_says_when_it_will_have_drained():
    room: WaitingRoom[int] = WaitingRoom(FlowConfig(max_queued=2))
    default = Objective("default")
    views = lambda: [_view("a", 4, queued=1000), _view("b", 4, queued=3000)]  # noqa: E731
    for key in (1, 2):
        room.arrive(key, default, "", 4000, 0.0, views)
    full = room.arrive(3, default, "", 4000, 0.0, views)
    assert isinstance(full, QueueFull) and full.backlog_drain_ms == pytest.approx(8000 / 2.0 + 1000.0)
    answer = queue_full_answer(2, full.share, full.backlog_drain_ms)
    assert answer.status == 429 and dict(answer.headers)[b"retry-after"] == b"5"
    assert json.loads(answer.body)["error"]["code"] == "queue_full"
