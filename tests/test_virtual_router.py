"""The virtual router knows only what the real one knows: its prefill clock, charged at dispatch, settled by first
tokens; and the closed loop's arrivals come from the shared generator with the same draws as before."""
from __future__ import annotations

import random

import pytest

from stallfree.operator.router.flow_control import FlowConfig
from stallfree.operator.router.pick import ReplicaView
from stallfree.simulator.closed_loop import LoadPhase, poisson_arrivals
from stallfree.simulator.virtual_replica import VirtualReplica
from stallfree.simulator.virtual_router import VirtualRouter
from stallfree.simulator.workload import Fixed, Uniform


def _router_and_replica(**replica_kwargs) -> tuple[VirtualRouter, VirtualReplica]:
    replica = None
    router = VirtualRouter(FlowConfig(dispatch_wait_ms=60_000.0), lambda name: replica.profile(), window_s=30.0)
    replica = VirtualReplica.for_model("llama-3-8b", "h100", name="r0", stats_window_s=30.0,
                                       observer=router.observer("r0"), **replica_kwargs)
    return router, replica


def _view(router: VirtualRouter, replica: VirtualReplica, now: float) -> ReplicaView:
    return router._known("r0", replica, now).view(now)


def test_the_router_sees_its_clock_not_the_scheduler_and_a_first_token_settles_it():
    router, replica = _router_and_replica()
    for _ in range(3):
        router.arrive(0.0, 4000, 4)
    assert router.dispatch(0.0, {"r0": replica}) == 3
    clock = router.replicas["r0"].clock
    assert clock.pending_tokens == 12000 and router.replicas["r0"].outstanding == 3
    predicted_end = clock.busy_until_s
    rate = router.replicas["r0"].prefill_tokens_per_ms() * 1000.0
    assert predicted_end == pytest.approx(12000 / rate)

    # The replica runs; what the router shows is its own prediction until a first token comes back.
    replica.advance_to(0.001)
    assert _view(router, replica, 0.001).queued_prefill_tokens == int(min((predicted_end - 0.001) * rate, 12000))

    replica.advance_to(60.0)
    router.dispatch(60.0, {"r0": replica})  # hears everything up to t=60: all three started and ended
    assert clock.pending_tokens == 0 and len(clock) == 0
    assert router.replicas["r0"].outstanding == 0
    assert _view(router, replica, 60.0).queued_prefill_tokens == 0


def test_a_first_token_counts_only_once_the_routers_time_reaches_it():
    router, replica = _router_and_replica()
    router.arrive(0.0, 6000, 50)
    router.dispatch(0.0, {"r0": replica})
    replica.advance_to(30.0)  # the first token comes back at some t_first < 30, the end later
    first = [r for r in router._replies if r[4] == 0]
    assert len(first) == 1
    t_first = first[0][0]
    router.dispatch(t_first - 1e-6, {"r0": replica})
    assert len(router.replicas["r0"].clock) == 1  # the router has not heard it yet
    router.dispatch(t_first, {"r0": replica})
    assert len(router.replicas["r0"].clock) == 0 and router.replicas["r0"].outstanding == 1  # still decoding


def test_a_slower_replica_than_its_profile_is_learnt_from_first_tokens_not_read_off_it():
    """Each first token later than predicted moves the requests behind it: the clock runs late with the replica."""
    from stallfree.simulator.speed import SlowedCostModel, SpeedSchedule

    router, replica = _router_and_replica()
    replica.executor.cost_model = SlowedCostModel(replica.cost_model, SpeedSchedule(0.5), replica.clock)
    for _ in range(4):
        router.arrive(0.0, 3000, 2)
    router.dispatch(0.0, {"r0": replica})
    clock = router.replicas["r0"].clock
    predicted = clock.busy_until_s
    assert router._replies == []  # nothing heard before the replica ran
    replica.advance_to(predicted)  # at half speed the first prompt takes twice its prediction
    heard = sorted(t for t, _, _, _, kind in router._replies if kind == 0)
    router.dispatch(heard[0], {"r0": replica})
    assert clock.busy_until_s > predicted  # the rest moved late by the first one's error


def test_replies_from_a_forgotten_replica_are_dropped():
    router, replica = _router_and_replica()
    router.arrive(0.0, 2000, 5)
    router.dispatch(0.0, {"r0": replica})
    replica.advance_to(10.0)
    assert router._replies
    router.forget(["r0"])  # it restarted: its in-flight requests failed
    assert not router._replies and "r0" not in router.replicas
    view = _view(router, replica, 10.0)  # a fresh record, nothing carried over
    assert view.outstanding == 0 and view.queued_prefill_tokens == 0 and len(router.replicas["r0"].clock) == 0


def test_requests_the_router_did_not_send_are_not_heard():
    router, replica = _router_and_replica()
    replica.submit(1000, 3, 0.0)  # straight to the replica, not through the router
    replica.advance_to(10.0)
    assert router._replies == []


def _old_poisson_arrivals(phase: LoadPhase, start: float, end: float, rng: random.Random):
    arrivals, t = [], start
    while True:
        t += rng.expovariate(phase.rate)
        if t >= end:
            return arrivals
        arrivals.append((t, phase.prompt_len.sample(rng), phase.output_len.sample(rng)))


def test_closed_loop_arrivals_keep_their_draws_on_the_shared_generator():
    phase = LoadPhase(0.0, 7.0, Uniform(16, 2048), Fixed(64))
    assert poisson_arrivals(phase, 5.0, 65.0, random.Random(9)) == _old_poisson_arrivals(phase, 5.0, 65.0,
                                                                                        random.Random(9))
    assert poisson_arrivals(LoadPhase(0.0, 0.0, Fixed(1), Fixed(1)), 0.0, 10.0, random.Random(1)) == []
