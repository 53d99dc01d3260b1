"""The control loop over real virtual replicas: acting, re-tuning restarts, resuming, failures, conditions."""
from __future__ import annotations

import json
from dataclasses import replace

from stallfree.contracts import Ceilings, Tuning
from stallfree.simulator.workload import parse_length
from stallfree.simulator.closed_loop import ClosedLoopDriver, ClusterSpec, LoadPhase
from stallfree.operator.control.loop import ControlLoop, ControlState
from stallfree.operator.control.policy import ControlPolicy, ScalingPolicy, SLOTargets

CLUSTER = ClusterSpec("mistral-7b", "a100", ceilings=Ceilings(2048, 256), start_tuning=Tuning(256, 64),
                      max_model_len=8192, startup_s=20)
POLICY = ControlPolicy(slo=SLOTargets(ttft_p99_ms=2000, tpot_p99_ms=60, queue_wait_p99_ms=1000),
                       scaling=ScalingPolicy(min_replicas=1, max_replicas=6, scale_up_stabilization_s=20,
                                             scale_down_stabilization_s=120),
                       interval_s=10, window_s=10)
CHAT = [LoadPhase(0, 4.0, parse_length("uniform:256:768"), parse_length("uniform:32:128"))]
# About 3 replicas' worth of 2-4k-token prompts.
HEAVY = [LoadPhase(0, 12.0, parse_length("uniform:2048:4096"), parse_length("uniform:16:48"))]


class FlakyActuator:
    """The virtual actuator behind calls that fail the first `failures` times (a 503, an API server hiccup)."""

    def __init__(self, inner, put_failures: int = 0, scale_failures: int = 0) -> None:
        self.inner, self.put_failures, self.scale_failures = inner, put_failures, scale_failures
        self.scale_calls = 0

    async def put_tuning(self, replica, tuning):
        if self.put_failures:
            self.put_failures -= 1
            raise ConnectionError("503 from the daemon")
        await self.inner.put_tuning(replica, tuning)

    async def set_replicas(self, replicas):
        self.scale_calls += 1
        if self.scale_failures:
            self.scale_failures -= 1
            raise ConnectionError("API server unavailable")
        await self.inner.set_replicas(replicas)

    async def record_event(self, reason, message, warning=False):
        await self.inner.record_event(reason, message, warning)


class EventsRefused(FlakyActuator):
    async def record_event(self, reason, message, warning=False):
        raise ConnectionError("events are forbidden")


class UnreadableQueue:
    async def observe_queue(self, now):
        raise ConnectionError("router down")


async def test_an_unreadable_router_queue_and_a_refused_event_are_logged_and_the_loop_goes_on(caplog):
    driver = ClosedLoopDriver(CLUSTER, POLICY, CHAT)
    driver.loop.actuator, driver.loop.queue_source = EventsRefused(driver.actuator), UnreadableQueue()
    with caplog.at_level("INFO", logger="stallfree.control"):
        steps = [await driver.step() for _ in range(2)]
        assert all(step.queue is None for step in steps) and steps[0].tuning[0].kind == "initial"
        driver.loop.queue_source = driver.observer
        assert (await driver.step()).queue is not None
    lines = [r.getMessage() for r in caplog.records]
    assert sum("queue is unreadable" in line and "router down" in line for line in lines) == 1  # once an outage
    assert any("readable again" in line for line in lines)
    assert any("not recorded" in line and "events are forbidden" in line for line in lines)


async def test_tuning_reaches_the_replica_and_a_restart_is_retuned():
    driver = ClosedLoopDriver(CLUSTER, POLICY, CHAT)
    first = await driver.step()
    desired = first.tuning[0].tuning
    assert first.tuning[0].kind == "initial" and desired != CLUSTER.start_tuning
    assert driver.cluster.slots["r0"].replica.tuning == desired  # the PUT landed
    for _ in range(3):
        await driver.step()
    desired = driver.loop.state.tuners["r0"].tuning
    driver.cluster.restart("r0", driver.t)  # comes back with its start-up flags
    assert driver.cluster.slots["r0"].replica.tuning == CLUSTER.start_tuning
    step = await driver.step()
    assert driver.cluster.slots["r0"].replica.tuning == desired
    assert any(e["reason"] == "TuningReapplied" for e in driver.actuator.events if e["t"] == step.time)


async def test_a_failed_put_is_recorded_and_retried():
    driver = ClosedLoopDriver(CLUSTER, POLICY, CHAT)
    driver.loop.actuator = FlakyActuator(driver.actuator, put_failures=1)
    step = await driver.step()
    assert step.failures and "503" in step.failures[0]
    assert driver.cluster.slots["r0"].replica.tuning == CLUSTER.start_tuning
    await driver.step()
    assert driver.cluster.slots["r0"].replica.tuning == driver.loop.state.tuners["r0"].tuning


async def scale_up_once(driver: ClosedLoopDriver, limit: int = 20):
    for _ in range(limit):
        step = await driver.step()
        if step.scale.changed:
            return step
    raise AssertionError("no scale-up")


async def test_resumes_from_status_without_scaling_twice():
    driver = ClosedLoopDriver(CLUSTER, POLICY, HEAVY)
    step = await scale_up_once(driver)
    assert step.scale.kind == "scaled_up" and driver.cluster.desired == step.scale.desired >= 3
    assert step.conditions[1].type == "PrefillCapacityExhausted" and step.conditions[1].status == "True"
    count = driver.cluster.desired
    # The operator restarts: a new loop from what the status recorded (through JSON, as the API server keeps it).
    recorded = json.loads(json.dumps(step.to_status()))["state"]
    driver.loop = ControlLoop(POLICY, driver.observer, driver.actuator, ControlState.from_dict(recorded))
    for _ in range(2):  # the new replicas are still starting
        step = await driver.step()
        assert not step.scale.changed and driver.cluster.desired == count
    # Even with its memory lost entirely it does not add replicas for demand the starting ones will carry.
    lost = ClosedLoopDriver(CLUSTER, POLICY, HEAVY)
    await scale_up_once(lost)
    lost.loop = ControlLoop(POLICY, lost.observer, lost.actuator, ControlState())
    step = await lost.step()
    assert not step.scale.changed
    # This loop reads no router queue, only r0. Routed on the router's own view (its prefill clock), flow control
    # may leave r0 nothing waiting at this step, so r0 does not read as exhausted: the loop then holds because the
    # new replicas are not ready yet (scale_in_blocked naming them), which is the same hold for the same reason.
    assert step.scale.reason in ("replicas_starting", "capacity_exhausted_waiting") or \
        (step.scale.reason == "scale_in_blocked" and "unknown (not ready)" in step.scale.message), step.scale


async def test_a_failed_scale_is_retried_and_external_mode_only_publishes():
    driver = ClosedLoopDriver(CLUSTER, POLICY, HEAVY)
    flaky = FlakyActuator(driver.actuator, scale_failures=1)
    driver.loop.actuator = flaky
    failed = await scale_up_once(driver)
    assert failed.failures and driver.cluster.desired == 1
    retried = await driver.step()
    assert retried.scale.changed and driver.cluster.desired == retried.scale.desired > 1 and flaky.scale_calls == 2

    external = replace(POLICY, scaling=replace(POLICY.scaling, mode="external"))
    driver = ClosedLoopDriver(CLUSTER, external, HEAVY)
    flaky = FlakyActuator(driver.actuator)
    driver.loop.actuator = flaky
    step = await scale_up_once(driver)
    assert flaky.scale_calls == 0 and driver.cluster.desired == 1
    assert driver.loop.state.desired_replicas == step.scale.desired > 1
    assert step.to_status()["scaling"]["desired"] == step.scale.desired


async def test_conditions_follow_the_data():
    driver = ClosedLoopDriver(CLUSTER, POLICY, CHAT, replicas=2)
    for _ in range(3):
        step = await driver.step()
    conditions = {c.type: c for c in step.conditions}
    assert conditions["SLOMet"].status == "True" and conditions["PrefillCapacityExhausted"].status == "False"
    driver.observer.unreadable.add("r1")
    step = await driver.step()
    conditions = {c.type: c for c in step.conditions}
    assert conditions["SLOMet"].status == "Unknown" and "r1" in conditions["SLOMet"].message
    assert step.to_status()["unknownReplicas"] == [
        {"name": "r1", "reason": "stats scrape failed: ConnectError: connection refused"}]
    assert any(e["reason"] == "ReplicaUnknown" for e in driver.actuator.events)
    driver.observer.unreadable.add("r0")
    step = await driver.step()
    conditions = {c.type: c for c in step.conditions}
    assert conditions["SLOMet"].status == "Unknown" and conditions["PrefillCapacityExhausted"].status == "Unknown"
    assert step.scale.reason == "no_known_replicas"
    overloaded = ClosedLoopDriver(CLUSTER, replace(POLICY, scaling=replace(POLICY.scaling, max_replicas=1)), HEAVY)
    for _ in range(4):
        step = await overloaded.step()
    conditions = {c.type: c for c in step.conditions}
    assert conditions["SLOMet"].status == "False" and "TTFT" in conditions["SLOMet"].message
