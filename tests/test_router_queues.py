"""Two routers, two queues: each router pod keeps its own flow-control queue, and the control loop reads every
ready router pod and sizes for the sum (operator/control/observe_router.py, k8s_actuator.router_urls)."""
from __future__ import annotations

import asyncio

import pytest

from kmock_bridge import BridgedEmulator
from stallfree.operator.control.observe_router import RouterQueueSource, summed_reader
from stallfree.operator.reconcile import render
from stallfree.operator.reconcile.k8s_actuator import router_urls
from stallfree.operator.reconcile.kube import Kube
from test_operator_kmock import NS, kubeconfig  # noqa: F401  (KUBECONFIG pointing at kmock, for every test)

pytestmark = pytest.mark.kmock(cls=BridgedEmulator)


def status(depth: int, queued: float, arrivals: int, tokens: float, oldest_ms: float) -> dict:
    """What one router's GET /router/queue answers (operator/router/proxy.py)."""
    return {"depth": depth, "queued_prompt_tokens": queued, "oldest_wait_ms": oldest_ms, "arrivals": arrivals,
            "arrived_prompt_tokens": tokens, "arrived_prompt_tokens_sq": tokens * 100.0}


def routers(*readings: list) -> tuple:
    """Readers of routers whose answers move through `readings` (None: that router cannot be read)."""
    step = {"i": 0}

    def reader(index: int):
        async def read():
            return readings[index][step["i"]]
        return read

    async def current() -> list:
        return [reader(i) for i in range(len(readings))]

    return current, step


async def test_the_loop_sizes_for_both_queues() -> None:
    current, step = routers([status(3, 300, 100, 10_000, 80), status(5, 500, 160, 16_000, 120)],
                            [status(1, 100, 50, 5_000, 400), status(0, 0, 90, 9_000, 0)])
    source = RouterQueueSource(summed_reader(current), window_s=10)
    first = await source.observe_queue(0.0)
    assert first is not None and first.depth == 4 and first.queued_prompt_tokens == 400
    assert first.oldest_wait_ms == 400  # the oldest request waits in the second router
    step["i"] = 1
    second = await source.observe_queue(10.0)
    assert second.depth == 5 and second.queued_prompt_tokens == 500
    # Arrivals over both: (160 + 90) - (100 + 50) requests and 10,000 prompt tokens in 10 s.
    assert second.arrival_requests_per_s == pytest.approx(10.0)
    assert second.arrival_prompt_tokens_per_s == pytest.approx(1_000.0)


async def test_a_router_that_cannot_be_read_leaves_the_others() -> None:
    current, _ = routers([status(2, 200, 10, 1_000, 50)], [None])
    observed = await RouterQueueSource(summed_reader(current), window_s=10).observe_queue(0.0)
    assert observed is not None and observed.depth == 2
    nobody, _ = routers([None], [None])
    assert await RouterQueueSource(summed_reader(nobody), window_s=10).observe_queue(0.0) is None


def pod(name: str, labels: dict, ip: str, port: int, ready: bool = True) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "x", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


async def test_every_ready_router_pod_is_read(kmock: BridgedEmulator) -> None:
    for body in (pod("chat-router-a", render.router_labels("chat"), "10.0.0.1", render.ROUTER_PORT),
                 pod("chat-router-b", render.router_labels("chat"), "10.0.0.2", render.ROUTER_PORT),
                 pod("chat-router-c", render.router_labels("chat"), "10.0.0.3", render.ROUTER_PORT, ready=False),
                 pod("chat-daemon", render.labels("chat"), "10.0.1.1", render.DAEMON_PORT),
                 pod("other-router", render.router_labels("other"), "10.0.2.1", render.ROUTER_PORT)):
        response = await kmock.post(f"/api/v1/namespaces/{NS}/pods", json=body)
        assert response.status in (200, 201)
    kube = Kube.from_environment()
    try:
        urls = await asyncio.to_thread(router_urls, kube, NS, "chat")
    finally:
        kube.close()
    assert urls == [f"http://10.0.0.1:{render.ROUTER_PORT}", f"http://10.0.0.2:{render.ROUTER_PORT}"]
