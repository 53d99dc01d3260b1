"""The router's waiting room (waiting_room.py), on times passed in: what the control loop reads of it per objective
(`/router/queue` through observe_router.py, as the operator reads production's and the simulator's router), and
the one goodput rule: a request is good when its queue wait and TTFT are within its objective's targets; shed,
refused, timed-out and lost requests are judged and not good."""
from __future__ import annotations

import pytest

from stallfree.operator.control.observe_router import RouterQueueSource
from stallfree.operator.router.flow_control import FlowConfig, Queued
from stallfree.operator.router.objectives import Objective, Objectives
from stallfree.operator.router.pick import pick
from stallfree.operator.router.replicas import Replica
from stallfree.operator.router.waiting_room import QueueFull, Shed, WaitingRoom

INTERACTIVE = Objective("interactive", 0, ttft_ms=1000.0, queue_wait_ms=500.0)
BATCH = Objective("batch", -1, ttft_ms=2000.0)


def _room(max_queued: int = 100) -> tuple[WaitingRoom[int], Replica]:
    room: WaitingRoom[int] = WaitingRoom(FlowConfig(max_queued=max_queued, dispatch_wait_ms=60_000.0),
                                         Objectives({o.name: o for o in (INTERACTIVE, BATCH)}, INTERACTIVE))
    replica = Replica("r0", url="virtual://r0", healthy=True, reason="ready")  # no stats yet: 1 token/ms
    return room, replica


def _send(room: WaitingRoom[int], replica: Replica, now: float) -> list[tuple[Queued[int], int]]:
    """Dispatch what the replica takes now; each with its ticket."""
    sent = room.dispatch([replica.view(now)], lambda item, views: pick("slo-aware", views, item.prompt_tokens, 0), now)
    return [(item, room.reserve(replica, item.prompt_tokens, now, item.sent_priority, item.tenant,
                                room.objectives.by_name[item.objective], item.arrival_s)) for item, _ in sent]


def test_the_control_loop_reads_each_objectives_goodput_from_the_room():
    room, replica = _room()
    source = RouterQueueSource(None, window_s=30.0)
    source.take(room.status(0.0), 0.0)
    views = lambda: [replica.view(1.0)]  # noqa: E731
    for key in (1, 2, 3):
        assert isinstance(room.arrive(key, INTERACTIVE, "a", 100, 1.0, views), Queued)
    (first, a), (second, b), (third, c) = _send(room, replica, 1.2)  # 200 ms in the queue
    room.first_byte(replica, a, 1.5)  # TTFT 500 ms: good
    room.first_byte(replica, b, 2.5)  # TTFT 1.5 s: late
    room.lost(c)  # its replica went away before its first byte
    room.lost(a)  # after its first byte: judged then, not again
    assert isinstance(room.arrive(4, BATCH, "b", 5000, 3.0, views), Shed)  # 5 s of prefill: past its 2 s
    windows = {w.name: w for w in source.take(room.status(10.0), 10.0).objectives}
    assert (windows["interactive"].completed, windows["interactive"].good) == (3, 1)
    assert windows["interactive"].goodput == pytest.approx(1 / 3)
    assert windows["interactive"].queue_wait_p99_ms == pytest.approx(200.0)
    assert windows["batch"].shed == 1 and windows["batch"].goodput == 0.0 and windows["batch"].sheddable
    assert windows["batch"].arrival_prompt_tokens_per_s == pytest.approx(5000 / 10.0)  # offered, shed included


def test_a_replicas_fast_error_is_judged_by_its_status_not_its_first_byte():
    """A 5xx or 429 back in 10 ms is the service failing the request: judged, not good, and no TTFT sample. A 400
    (the request's own fault) is not judged at all."""
    room, replica = _room()
    source = RouterQueueSource(None, window_s=30.0)
    source.take(room.status(0.0), 0.0)
    views = lambda: [replica.view(0.0)]  # noqa: E731
    for key in (1, 2, 3, 4):
        room.arrive(key, INTERACTIVE, "a", 10, 0.0, views)
    (_, ok), (_, failed), (_, busy), (_, junk) = _send(room, replica, 0.0)
    room.first_byte(replica, ok, 0.5)
    room.first_byte(replica, failed, 0.01, status=503)
    room.first_byte(replica, busy, 0.01, status=429)
    room.first_byte(replica, junk, 0.01, status=400)
    window = {w.name: w for w in source.take(room.status(1.0), 1.0).objectives}["interactive"]
    assert (window.completed, window.good) == (3, 1)
    assert room.status(1.0)["objectives"]["interactive"]["p99_ttft_ms"] == pytest.approx(500.0)


def test_a_request_refused_by_a_full_queue_or_timed_out_is_judged_not_good():
    room, replica = _room(max_queued=1)
    views = lambda: [replica.view(0.0)]  # noqa: E731
    assert isinstance(room.arrive(1, INTERACTIVE, "", 100, 0.0, views), Queued)
    full = room.arrive(2, INTERACTIVE, "", 100, 0.0, views)
    assert isinstance(full, QueueFull) and full.share is None
    room.unserved(INTERACTIVE)  # the first timed out in the queue
    figures = room.status(1.0)["objectives"]["interactive"]
    assert (figures["completed"], figures["good"]) == (2, 0)
    assert room.status(1.0)["arrived_prompt_tokens"] == 100  # only what was queued counts as arrived


def test_a_queue_wait_past_its_target_is_not_good_though_the_ttft_is():
    room, replica = _room()
    assert isinstance(room.arrive(1, INTERACTIVE, "", 100, 0.0, lambda: [replica.view(0.0)]), Queued)
    [(item, ticket)] = _send(room, replica, 0.6)  # 600 ms in the queue: past 500
    room.first_byte(replica, ticket, 0.9)  # TTFT 900 ms: within 1 s
    figures = room.status(1.0)["objectives"]["interactive"]
    assert (figures["completed"], figures["good"]) == (1, 0)
    room.release(replica, ticket, 1.0)
    assert (replica.outstanding, replica.held) == (0, {})
