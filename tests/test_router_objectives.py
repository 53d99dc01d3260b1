"""Objectives at the router (issue 33): the queue's order (bands, tenants, deadlines), the 400 for an unknown
objective, shedding at arrival, and the per-objective metrics, at the flow-control level and over real HTTP."""
from __future__ import annotations

import json
import threading
import time

import httpx

from router_fakes import FAKE_MODEL, fake_replica
from server_helpers import running_daemon
from stallfree.operator.router.flow_control import FlowConfig, FlowQueue, Queued
from stallfree.operator.router.objectives import Objective
from stallfree.operator.router.pick import Choice, ReplicaView, pick_slo_aware
from stallfree.operator.router.shedding import Reserve, drain_ms, predicted_ttft_ms, sheds
from test_router_proxy import MODEL, router, wait_until
from test_router_queue import ONE_SLOT, _queue, _replicas

OBJECTIVES = json.dumps([{"name": "interactive", "priority": 10, "ttftP99Ms": 600000, "default": True},
                         {"name": "batch", "priority": -1, "ttftP99Ms": 600000}])


def view(name: str = "a", queued: int = 0, rate: float = 1.0, outstanding: int = 0,
         seqs: int | None = 8) -> ReplicaView:
    return ReplicaView(name, queued_prefill_tokens=queued, prefill_tokens_per_ms=rate, step_ms=10.0,
                       outstanding=outstanding, max_num_seqs=seqs)


def first(item, candidates) -> Choice:
    return pick_slo_aware(candidates, item.prompt_tokens)


def _keys(queue: FlowQueue) -> list:
    return [q.key for q in queue.ordered()]


# -- the queue's order ------------------------------------------------------------------------------------

def test_priority_bands_are_served_strictly_in_order():
    queue: FlowQueue[str] = FlowQueue(FlowConfig(dispatch_wait_ms=100.0))
    queue.push(Queued("batch-old", 0.0, 10, objective="batch", priority=-1, deadline_s=1.0))
    queue.push(Queued("normal", 1.0, 10, objective="normal", priority=0, deadline_s=500.0))
    queue.push(Queued("chat", 2.0, 10, objective="chat", priority=10, deadline_s=900.0))
    # However old the lower band's request, and however near its deadline, the higher bands go first.
    assert _keys(queue) == ["chat", "normal", "batch-old"]
    # One free slot: the highest band takes it; the rest wait.
    sent = queue.dispatch([view(outstanding=7, seqs=8)], first)
    assert [item.key for item, _ in sent] == ["chat"]
    assert _keys(queue) == ["normal", "batch-old"]


def test_tenants_in_a_band_take_turns_the_least_recently_served_first():
    queue: FlowQueue[str] = FlowQueue(FlowConfig(dispatch_wait_ms=100.0))
    for i in range(4):
        queue.push(Queued(f"flood{i}", float(i), 10, tenant="flood"))
    queue.push(Queued("quiet0", 10.0, 10, tenant="quiet"))
    queue.push(Queued("quiet1", 11.0, 10, tenant="quiet"))
    # The flood arrived first, so it starts; then the quiet tenant's turn, not the flood's next three.
    assert _keys(queue) == ["flood0", "quiet0", "flood1", "quiet1", "flood2", "flood3"]
    sent = queue.dispatch([view(outstanding=7, seqs=8)], first)
    assert [item.key for item, _ in sent] == ["flood0"]
    # The flood was served last: the quiet tenant goes first now, though its request arrived later.
    assert _keys(queue) == ["quiet0", "flood1", "quiet1", "flood2", "flood3"]
    sent = queue.dispatch([view(outstanding=6, seqs=8)], first)
    assert [item.key for item, _ in sent] == ["quiet0", "flood1"]


def test_within_a_tenant_the_earliest_deadline_goes_first():
    queue: FlowQueue[str] = FlowQueue(FlowConfig(dispatch_wait_ms=100.0))
    queue.push(Queued("relaxed", 0.0, 10, tenant="t", deadline_s=30.0))  # arrived first, 30 s target
    queue.push(Queued("urgent", 1.0, 10, tenant="t", deadline_s=1.5))  # arrived later, 0.5 s target
    queue.push(Queued("middle", 2.0, 10, tenant="t", deadline_s=5.0))
    assert _keys(queue) == ["urgent", "middle", "relaxed"]


def test_without_objectives_the_order_is_arrival_and_a_retry_keeps_its_place_first():
    queue: FlowQueue[int] = FlowQueue(FlowConfig(dispatch_wait_ms=100.0))
    for key in (5, 3, 9):
        queue.push(Queued(key, float(key), 10))  # arrival order is push order, whatever the keys
    queue.push(Queued(1, 0.5, 10), front=True)
    assert _keys(queue) == [1, 5, 3, 9]
    assert queue.depth_by_objective() == {"": 4}


def test_the_fairness_memory_holds_only_tenants_still_waiting():
    queue: FlowQueue[str] = FlowQueue(FlowConfig(dispatch_wait_ms=100.0))
    for i in range(100):
        queue.push(Queued(f"r{i}", float(i), 1, tenant=f"tenant{i}"))
    queue.dispatch([view(seqs=None)], first)
    assert len(queue) == 0 and queue._served_at == {}


# -- shedding: pure ---------------------------------------------------------------------------------------

def test_a_sheddable_request_is_shed_only_when_it_misses_at_every_replica_counting_those_starting():
    batch = Objective("batch", -1, ttft_ms=1000.0)
    busy, idle = view("busy", queued=5000), view("idle", queued=0)
    assert predicted_ttft_ms([busy, idle], 100, 0) == 110.0  # the idle one: 100 tokens at 1/ms + a step
    assert sheds(batch, [busy, idle], [], 100, 0) is None  # one replica meets it
    assert sheds(batch, [busy], [], 100, 0) == 5110.0  # every replica misses
    assert sheds(batch, [idle], [], 100, 2000) == 2110.0  # the router's queue ahead of it counts too
    # A replica starting, ready in 500 ms: it may take this one itself then (500 + 100 tokens at 1/ms + a step).
    assert sheds(batch, [busy], [500.0], 100, 0) is None
    assert predicted_ttft_ms([busy], 100, 0, starting_in_ms=[500.0]) == 610.0
    assert sheds(batch, [busy], [5000.0], 100, 0) == 5110.0  # ready too late to help
    # It joins the drain of the router's queue when ready: 2000 tokens ahead, 500 at 1/ms, the rest at 2/ms.
    assert predicted_ttft_ms([idle], 100, 2000, starting_in_ms=[500.0]) == 500.0 + 750.0 + 110.0
    assert sheds(Objective("chat", 0, ttft_ms=1000.0), [busy], [], 100, 0) is None  # not sheddable: it waits
    assert sheds(batch, [], [], 100, 0) is None  # nothing to predict on


def test_the_drain_speeds_up_as_starting_replicas_join():
    assert drain_ms(1000, 1.0, []) == 1000.0
    assert drain_ms(1000, 1.0, [(200.0, 1.0)]) == 200.0 + 400.0
    assert drain_ms(100, 1.0, [(200.0, 1.0)]) == 100.0  # done before it joins
    assert drain_ms(2000, 1.0, [(600.0, 2.0), (200.0, 1.0)]) == 600.0 + 1000.0 / 4.0  # in time order
    assert drain_ms(0, 1.0, [(200.0, 1.0)]) == 0.0


def test_the_higher_bands_reserve_slows_the_whole_wait_the_replicas_queue_too():
    batch = Objective("batch", -1, ttft_ms=1000.0)
    half = view("half", queued=400)  # 400 queued + 100 prompt at 1 token/ms: 500 ms, + a 10 ms step
    assert predicted_ttft_ms([half], 100, 0) == 510.0
    # The interactive band takes half of the prefill: on the replica, it passes what is queued there too.
    assert predicted_ttft_ms([half], 100, 0, Reserve(0.5, 0.5)) == 1010.0
    assert predicted_ttft_ms([half], 100, 200, Reserve(0.5, 0.5)) == 1410.0  # the router's queue as well
    assert sheds(batch, [half], [], 100, 0) is None
    assert sheds(batch, [half], [], 100, 0, Reserve(0.5, 0.5)) == 1010.0
    # The reserve over the router's queue and the one on the replica each slow their own part of the wait.
    assert predicted_ttft_ms([half], 100, 200, Reserve(0.5, 0.0)) == 510.0 + 400.0
    assert predicted_ttft_ms([half], 100, 200, Reserve(0.0, 0.5)) == 1010.0 + 200.0


# -- over HTTP --------------------------------------------------------------------------------------------

def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=5).text


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    raise AssertionError(f"{series} not exported")


def test_an_unknown_objective_is_a_400_naming_it_and_never_counts_as_demand():
    with fake_replica() as fake, router([fake.url], "--objectives", OBJECTIVES) as url:
        body = {"model": FAKE_MODEL, "prompt": "hello"}
        answer = httpx.post(url + "/v1/completions", json=body, headers={"x-stallfree-objective": "gold"}, timeout=10)
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["code"] == "unknown_objective" and "`gold`" in error["message"]
        assert "`batch`" in error["message"] and "`interactive`" in error["message"]
        assert _queue(url)["arrivals"] == 0 and fake.inference() == []
        # Named, unnamed (the default) and with a tenant: served.
        for headers in ({"x-stallfree-objective": "interactive"}, {}, {"x-gateway-inference-fairness-id": "t1"}):
            assert httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=10).status_code == 200
        text = _metrics(url)
        assert _value(text, 'stallfree_router_refused_total{reason="unknown_objective"}') == 1.0
        assert _value(text, 'stallfree_router_objective_requests_total{objective="interactive",outcome="dispatched"}') \
            == 3.0
        assert _value(text, 'stallfree_router_objective_queue_wait_seconds_count{objective="interactive"}') == 3.0
        assert _value(text, 'stallfree_router_objective_queue_depth{objective="batch"}') == 0.0
        assert _value(text, 'stallfree_router_objective_observed_ttft_seconds_count{objective="interactive"}') == 3.0
        status = _queue(url)
        interactive = status["objectives"]["interactive"]
        # Its p99s over the router's window, the answered ones and those within the TTFT target (all three).
        assert 0.0 < interactive.pop("p99_queue_wait_ms") <= interactive.pop("p99_ttft_ms") < 10_000.0
        assert status["objectives"] == {
            "interactive": {"priority": 10, "ttft_ms": 600000.0, "depth": 0, "shed": 0, "offered": 3,
                            "offered_prompt_tokens": status["arrived_prompt_tokens"], "completed": 3, "good": 3},
            "batch": {"priority": -1, "ttft_ms": 600000.0, "depth": 0, "shed": 0, "offered": 0,
                      "offered_prompt_tokens": 0, "completed": 0, "good": 0, "p99_ttft_ms": None,
                      "p99_queue_wait_ms": None}}
        # The objective headers are the router's: none reaches the replica.
        assert all("x-stallfree-objective" not in headers for _, _, headers in fake.inference())


def test_a_sheddable_request_predicted_to_miss_is_refused_at_arrival_and_a_non_sheddable_one_waits():
    tight = json.dumps([{"name": "chat", "priority": 0, "ttftP99Ms": 1},
                        {"name": "batch", "priority": -5, "ttftP99Ms": 1}])
    with fake_replica() as fake, router([fake.url], "--objectives", tight) as url:
        body = {"model": FAKE_MODEL, "prompt": "x" * 400}  # ~100 tokens and a step: far over 1 ms
        shed = httpx.post(url + "/v1/completions", json=body, headers={"x-stallfree-objective": "batch"}, timeout=10)
        assert shed.status_code == 429 and int(shed.headers["retry-after"]) >= 1
        assert shed.json()["error"]["code"] == "shed_predicted_miss"
        assert "batch" in shed.json()["error"]["message"]
        waited = httpx.post(url + "/v1/completions", json=body, headers={"x-stallfree-objective": "chat"}, timeout=10)
        assert waited.status_code == 200
        assert len(fake.inference()) == 1  # the shed one never reached a replica
        text = _metrics(url)
        assert _value(text, 'stallfree_router_objective_requests_total{objective="batch",outcome="shed"}') == 1.0
        assert _value(text, 'stallfree_router_refused_total{reason="shed_predicted_miss"}') == 1.0
        assert _value(text, 'stallfree_router_objective_ttft_missed_total{objective="chat"}') == 1.0
        status = _queue(url)
        assert status["arrivals"] == 1  # a shed request is no demand: it was refused before the queue
        assert status["objectives"]["batch"]["shed"] == 1 and status["objectives"]["chat"]["shed"] == 0
        # Offered per objective counts the shed one too: what the control loop sizes a sheddable share from.
        assert status["objectives"]["batch"]["offered"] == 1 and status["objectives"]["chat"]["offered"] == 1
        # The chat request was answered past its 1 ms target: counted, not good.
        assert (status["objectives"]["chat"]["completed"], status["objectives"]["chat"]["good"]) == (1, 0)


def test_a_higher_band_waiting_behind_a_lower_one_is_served_first_over_http():
    with running_daemon(base_args=ONE_SLOT) as daemon, router([daemon.url], "--objectives", OBJECTIVES) as url:
        wait_until(lambda: all(r["max_num_seqs"] == 1 for r in _replicas(url).values()), 10)
        long = {"model": MODEL, "prompt": "go on", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        short = {"model": MODEL, "prompt": "x", "max_tokens": 8, "ignore_eos": True}
        done: dict[str, float] = {}

        def send(objective: str) -> None:
            answer = httpx.post(url + "/v1/completions", json=short, timeout=60,
                                headers={"x-stallfree-objective": objective})
            assert answer.status_code == 200, answer.text
            done[objective] = time.monotonic()

        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            next(lines)  # the replica's one slot is taken
            batch = threading.Thread(target=send, args=("batch",))
            batch.start()
            wait_until(lambda: _queue(url)["depth"] == 1, 10)
            chat = threading.Thread(target=send, args=("interactive",))
            chat.start()
            wait_until(lambda: _queue(url)["depth"] == 2, 10)
        # The slot frees: the interactive request, queued after the batch one, runs first.
        batch.join(30)
        chat.join(30)
        assert done["interactive"] < done["batch"]
