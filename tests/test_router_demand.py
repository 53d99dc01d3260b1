"""Demand counts only what a replica accepted: a request the replica refuses at once (a 4xx) and a 429 queue_full
at the router add nothing to the arrivals the scaler sizes from, so a client's junk cannot buy replicas."""
from __future__ import annotations

import httpx

from server_helpers import ADMIN_TOKEN, running_daemon
from stallfree.operator.control.observe_router import RouterQueueSource
from stallfree.operator.router.flow_control import FlowConfig
from stallfree.operator.router.objectives import Objective
from stallfree.operator.router.waiting_room import QueueFull, WaitingRoom
from test_router_proxy import MODEL, SIM_ARGS, router

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_a_queue_full_refusal_is_no_arrival():
    room: WaitingRoom[int] = WaitingRoom(FlowConfig(max_queued=1))
    default = Objective("default")
    assert not isinstance(room.arrive(1, default, "", 100, 0.0, lambda: []), QueueFull)
    assert isinstance(room.arrive(2, default, "", 100, 0.0, lambda: []), QueueFull)
    status = room.status(0.0)
    assert (status["arrivals"], status["arrived_prompt_tokens"], status["rejected"]) == (1, 100, 1)


def test_arrivals_a_replica_refused_are_taken_out_of_the_demand_the_control_loop_sees():
    source = RouterQueueSource(None, window_s=30.0)
    base = {"depth": 0, "queued_prompt_tokens": 0, "oldest_wait_ms": 0.0}
    source.take({**base, "arrivals": 10, "arrived_prompt_tokens": 1000, "arrived_prompt_tokens_sq": 100_000}, 0.0)
    seen = source.take({**base, "arrivals": 310, "arrived_prompt_tokens": 2_420_200,
                        "arrived_prompt_tokens_sq": 100_000 + 300 * 8064 ** 2, "refused_by_replica": 300,
                        "refused_prompt_tokens": 2_419_200, "refused_prompt_tokens_sq": 300 * 8064 ** 2}, 10.0)
    assert seen.arrival_prompt_tokens_per_s == 0.0 and seen.arrival_requests_per_s == 0.0
    assert seen.recent_prompt_tokens == 0.0 and seen.recent_requests == 0


def test_over_http_requests_the_replica_refuses_add_no_demand():
    with running_daemon(base_args=SIM_ARGS) as daemon, router([daemon.url]) as url:
        junk = [{"model": MODEL, "prompt": "x" * 4000, "temperature": 5},
                {"model": MODEL, "prompt": "x" * 4000, "stop": [str(i) for i in range(17)]}]
        for body in junk:
            answer = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert answer.status_code == 400, answer.text
        assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "y" * 40, "max_tokens": 2},
                          timeout=30).status_code == 200
        status = httpx.get(url + "/router/queue", headers=ADMIN, timeout=5).json()
        assert status["refused_by_replica"] == 2 and status["arrivals"] == 3
        accepted = status["arrived_prompt_tokens"] - status["refused_prompt_tokens"]
        assert 0 < accepted <= 20  # only the accepted one's ~10 tokens of the ~2,000 that arrived
