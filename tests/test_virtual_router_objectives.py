"""The virtual router serves objectives and tenants with production's pieces: priority bands and deadlines in the
flow queue, shedding at arrival for a sheddable objective predicted to miss at every ready replica (none while one
is starting), and what became of each request per objective."""
from __future__ import annotations

import pytest

from stallfree.operator.router.flow_control import FlowConfig
from stallfree.operator.router.objectives import Objective, Objectives
from stallfree.simulator.virtual_replica import VirtualReplica
from stallfree.simulator.virtual_router import VirtualRouter

INTERACTIVE = Objective("interactive", 0, ttft_ms=3000.0, tpot_ms=200.0, queue_wait_ms=2000.0)
BATCH = Objective("batch", -1, ttft_ms=2000.0)


def _setup(dispatch_wait_ms: float = 60_000.0) -> tuple[VirtualRouter, VirtualReplica]:
    replica = None
    router = VirtualRouter(FlowConfig(dispatch_wait_ms=dispatch_wait_ms), lambda name: replica.profile(), window_s=30.0,
                           objectives=Objectives({o.name: o for o in (INTERACTIVE, BATCH)}, INTERACTIVE))
    replica = VirtualReplica.for_model("llama-3-8b", "h100", name="r0", stats_window_s=30.0,
                                       observer=router.observer("r0"))
    return router, replica


def test_a_sheddable_request_predicted_to_miss_everywhere_is_refused_at_arrival():
    router, replica = _setup()
    rate = router._known("r0", replica, 0.0).prefill_tokens_per_ms()
    big = int(rate * 3000)  # three seconds of prefill: past batch's 2 s target
    assert router.arrive(0.0, big, 4, "interactive", ready={"r0": replica})
    assert not router.arrive(0.0, 1000, 4, "batch", "t", ready={"r0": replica})  # behind it: predicted to miss
    # A replica starting counts from when it is expected ready (a 60 s start-up until one is seen): one that has
    # just started is no help to a 2 s target; one about to be ready takes the queue's half and this one in time.
    assert not router.arrive(0.0, 1000, 4, "batch", "t", ready={"r0": replica}, starting=[0.0])
    assert router.arrive(0.0, 1000, 4, "batch", "t", ready={"r0": replica}, starting=[60.0])
    assert router.arrive(0.0, 1000, 4, "interactive", ready={"r0": replica})  # not sheddable: it waits
    summary = router.outcomes.summary()
    assert summary["batch"]["shed"] == 2


def test_bands_go_first_and_an_unknown_objective_is_refused():
    router, replica = _setup(dispatch_wait_ms=0.0)  # one request at a time: the queue's order shows
    router.arrive(0.0, 500, 2, "batch", ready={"r0": replica})
    router.arrive(0.001, 500, 2, "interactive", ready={"r0": replica})
    assert [q.objective for q in router.queue.ordered()] == ["interactive", "batch"]
    assert router.queue.ordered()[0].deadline_s is not None  # arrival + target - prefill
    with pytest.raises(ValueError, match="not one of"):
        router.arrive(0.0, 500, 2, "nope")


def test_each_request_is_judged_against_its_objective_and_reported_per_objective():
    router, replica = _setup()
    for i in range(4):
        router.arrive(i * 0.01, 500, 4, "interactive", tenant="a", ready={"r0": replica})
    t = 0.0
    while t < 5.0:
        router.dispatch(t, {"r0": replica})
        t += 0.05
        replica.advance_to(t)
    router.dispatch(t, {"r0": replica})
    snapshot = router.snapshot(t)
    by_name = {w.name: w for w in snapshot.objectives}
    assert by_name["interactive"].completed == 4 and by_name["interactive"].goodput == 1.0
    assert by_name["interactive"].ttft_p99_ms is not None and by_name["batch"].completed == 0
    assert router.outcomes.summary()["interactive"]["served"] == 4


def test_a_request_sent_below_its_band_gives_up_its_deadline():
    router, replica = _setup()
    assert router.arrive(0.0, 500, 2, "interactive", "flood", ready={"r0": replica})
    item = router.queue.ordered()[0]
    signed = router.room.signed(INTERACTIVE, item.sent_priority, item.arrival_s)  # what the engine is told
    assert signed.deadline_s == pytest.approx(3.0)  # arrival + the 3 s TTFT target
    item.demoted = True  # its tenant past its share (flow_control): one band down, no deadline to age by
    signed = router.room.signed(INTERACTIVE, item.sent_priority, item.arrival_s)
    assert (signed.priority, signed.deadline_s) == (-1, None)
