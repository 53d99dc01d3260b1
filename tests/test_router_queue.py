"""Flow control over real HTTP: requests wait in the router's queue (not on a replica), bounded, cancellable."""
from __future__ import annotations

import threading

import httpx

from test_router_proxy import MODEL, SIM_ARGS, router, wait_until
from server_helpers import ADMIN_TOKEN, running_daemon

ONE_SLOT = [a if a != "16" else "1" for a in SIM_ARGS]  # max_num_seqs 1: one request runs at a time


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _replicas(url: str) -> dict:
    return httpx.get(url + "/router/replicas", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5).json()


def _queue(url: str) -> dict:
    return httpx.get(url + "/router/queue", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5).json()


def test_requests_wait_in_the_router_past_the_bound_429_and_run_when_the_slot_frees():
    with running_daemon(base_args=ONE_SLOT) as daemon, router([daemon.url], "--max-queued", "1") as url:
        wait_until(lambda: all(r["max_num_seqs"] == 1 for r in _replicas(url).values()),
                   10)
        long = {"model": MODEL, "prompt": "go on", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        short = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        results: dict[str, httpx.Response] = {}
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            next(lines)  # running: the replica's one slot is taken
            waiter = threading.Thread(target=lambda: results.update(
                queued=httpx.post(url + "/v1/completions", json=short, timeout=60)))
            waiter.start()
            wait_until(lambda: _queue(url)["depth"] == 1, 10)
            assert _metric(url, "stallfree_router_queue_depth") == 1.0
            assert daemon.llm_engine.scheduler.num_waiting == 0  # it waits at the router, not on the replica
            full = httpx.post(url + "/v1/completions", json=short, timeout=10)
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full"
        # The stream closed: its slot is free, the queued request goes and completes.
        waiter.join(30)
        assert results["queued"].status_code == 200, results["queued"].text
        status = _queue(url)
        assert status["depth"] == 0 and status["rejected"] == 1 and status["dispatched"] >= 2
        assert _metric(url, "stallfree_router_queue_rejected_total") == 1.0
        assert _metric(url, "stallfree_router_queue_wait_seconds_count") >= 2.0


def test_a_client_that_leaves_while_queued_is_removed_and_counted():
    with running_daemon(base_args=ONE_SLOT) as daemon, router([daemon.url]) as url:
        wait_until(lambda: all(r["max_num_seqs"] == 1 for r in _replicas(url).values()),
                   10)
        long = {"model": MODEL, "prompt": "go on", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()  # kept: a collected line iterator would close the stream
            next(lines)
            with httpx.Client(timeout=httpx.Timeout(60, read=1.0)) as impatient:
                try:
                    impatient.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                except httpx.ReadTimeout:
                    pass  # it gave up and closed the connection while queued
            wait_until(lambda: _queue(url)["cancelled"] == 1, 10)
            assert _queue(url)["depth"] == 0
            assert _metric(url, "stallfree_router_queue_cancelled_total") == 1.0
        wait_until(lambda: not daemon.llm_engine.has_unfinished(), 10)  # nothing of it reached the replica


def test_the_time_queued_at_the_router_counts_in_the_replicas_queue_wait():
    import time

    from stallfree.node_daemon.server.generation import RouterWait
    from stallfree.router_queue_header import SIGNATURE_HEADER, sign

    def signed(value: str) -> dict[str, str]:
        return {"x-stallfree-router-queue-ms": value, SIGNATURE_HEADER: sign(value, ADMIN_TOKEN, time.time())}

    wait = RouterWait()
    assert wait.seconds(signed("1500"), ADMIN_TOKEN) == 1.5
    for bad in ("nan", "-5", "abc", ""):
        assert wait.seconds(signed(bad), ADMIN_TOKEN) == 0.0
    assert wait.seconds(signed("1e12"), ADMIN_TOKEN) == 600.0  # bounded
    with running_daemon(base_args=SIM_ARGS) as daemon:
        response = httpx.post(daemon.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                              headers=signed("2500"), timeout=30)
        assert response.status_code == 200
        stats = httpx.get(daemon.url + "/admin/stats", headers={"Authorization": "Bearer " + ADMIN_TOKEN},
                          timeout=5).json()
        assert stats["queue_wait_ms"]["max"] >= 2500.0
        assert stats["ttft_ms"]["max"] >= 2500.0
