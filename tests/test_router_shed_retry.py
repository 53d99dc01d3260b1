"""A shed request's Retry-After is when the backlog there is now will have drained, never the cap because nothing
was known: a prediction of 6.4e10 ms (higher bands' reserve over the whole rate) with no backlog said
`Retry-After: 60`, and a retry then was served in 0.1 s."""
from __future__ import annotations

import json

from stallfree.operator.router.answers import shed_answer
from stallfree.operator.router.flow_control import FlowConfig
from stallfree.operator.router.objectives import Objective, Objectives
from stallfree.operator.router.pick import ReplicaView
from stallfree.operator.router.shedding import backlog_drain_ms
from stallfree.operator.router.waiting_room import Shed, WaitingRoom


def _view(queued: int = 0, rate: float = 1.0) -> ReplicaView:
    return ReplicaView("a", queued_prefill_tokens=queued, prefill_tokens_per_ms=rate, step_ms=10.0, outstanding=0)


def _retry_after(answer) -> int:
    return int(dict(answer.headers)[b"retry-after"])


def test_retry_after_is_the_backlogs_drain_not_the_predicted_overrun():
    assert backlog_drain_ms([], 5000) == 0.0
    assert backlog_drain_ms([_view(), _view()], 4000) == 2000.0  # the router's queue over both
    assert backlog_drain_ms([_view(queued=3000), _view(queued=1000)], 0) == 1000.0  # the least-loaded replica
    nothing_left = shed_answer("batch", 6.4e10, 1000.0, backlog_drain_ms([_view()], 0))
    assert _retry_after(nothing_left) == 1
    assert "over an hour" in json.loads(nothing_left.body)["error"]["message"]
    assert _retry_after(shed_answer("batch", 9000.0, 1000.0, backlog_drain_ms([_view()], 4500))) == 5
    assert _retry_after(shed_answer("batch", 9000.0, 1000.0, 10 * 3600 * 1000.0)) == 60  # the cap


def test_the_waiting_room_sheds_with_the_backlogs_drain():
    batch = Objective("batch", -1, ttft_ms=1.0)
    room: WaitingRoom[int] = WaitingRoom(FlowConfig(), Objectives({"batch": batch}, batch))
    shed = room.arrive(1, batch, "", 100, 0.0, lambda: [_view(queued=2500)])
    assert isinstance(shed, Shed) and shed.backlog_drain_ms == 2500.0
