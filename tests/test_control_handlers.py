"""The control loop inside the real kopf operator, against kmock's API server and a live sim daemon.

One daemon (`stallfree serve --backend sim`, in-process on a loopback port) stands as the pod of an
InferenceService; kmock holds the InferenceService, its admin Secret and that Pod (podIP 127.0.0.1,
port `http` = the daemon's). The operator runs the reconciler and the control handlers together.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import kopf.testing
import pytest

from kmock_bridge import BridgedEmulator
from server_helpers import ADMIN_TOKEN, free_port, running_daemon
from stallfree.operator.reconcile import render
from stallfree.operator.api import spec as s
from test_operator_kmock import IS_RESOURCE, NS, condition, create, eventually, events, kubeconfig, obj  # noqa: F401

pytestmark = pytest.mark.kmock(cls=BridgedEmulator)

SIM_DAEMON = ["--backend", "sim", "--model", "llama-3-8b", "--hardware", "h100", "--max-model-len", "4096",
              "--max-token-budget", "2048", "--max-num-seqs-ceiling", "128", "--max-num-seqs", "64",
              "--token-budget", "512", "--stats-window-s", "3", "--profile-max-seconds", "5"]


@pytest.fixture(scope="module")
def daemon():
    with running_daemon(base_args=SIM_DAEMON) as live:
        yield live


@pytest.fixture()
def traffic(daemon):
    """Steady small requests for the daemon's stats window (bounded: stops with the test, 60 s at most)."""
    stop = threading.Event()

    def send() -> None:
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=10) as client:
            while not stop.is_set() and time.monotonic() < deadline:
                client.post(f"{daemon.url}/v1/completions",
                            json={"model": "llama-3-8b", "prompt": "tell me a story " * 20, "max_tokens": 12})

    threads = [threading.Thread(target=send, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    yield
    stop.set()
    for thread in threads:
        thread.join(timeout=15)


def last_step(kmock) -> float:
    return obj(kmock, IS_RESOURCE, "chat")["status"]["control"]["lastStepTime"]


async def another_step(kmock, after: float | None = None, timeout: float = 15) -> float:
    """Wait until the control loop has written a step later than `after` (default: the last one); returns its time."""
    after = last_step(kmock) if after is None else after
    return await eventually(lambda: (t := last_step(kmock)) > after and t, timeout=timeout)


class Operator:
    def __init__(self, metrics_port: int) -> None:
        self.metrics_port = metrics_port
        self.runner = kopf.testing.KopfRunner(
            ["run", "--standalone", "--namespace", NS, "-m", "stallfree.operator.reconcile.handlers",
             "-m", "stallfree.operator.reconcile.control_handlers"], timeout=30)

    async def __aenter__(self) -> "Operator":
        self.runner.__enter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.runner.__exit__, None, None, None)
        assert self.runner.exit_code == 0, self.runner.output


def daemon_pod(name: str, port: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": render.labels("chat")},
            "spec": {"containers": [{"name": "daemon", "image": "x",
                                     "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "daemon", "restartCount": 0}]}}


def service(**spec: Any) -> dict[str, Any]:
    body = {"model": {"source": "random", "name": "llama-3-8b"},
            "engine": {"backend": "sim", "hardware": "h100", "ceilings": {"maxTokenBudget": 2048, "maxNumSeqs": 128},
                       "tokenBudget": {"initial": "auto", "max": 1024}, "maxNumSeqs": {"initial": 64}},
            "slos": {"tpotP99Ms": 50, "ttftP99Ms": 2000, "queueWaitP99Ms": 1000, "windowSeconds": 5},
            "tuning": {"intervalSeconds": 1}, "scaling": {"minReplicas": 1, "maxReplicas": 3}}
    body.update(spec)
    return {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": "chat", "namespace": NS}, "spec": body}


async def test_the_operator_tunes_a_live_daemon_reports_and_resumes(kmock: BridgedEmulator, daemon, traffic,
                                                                   monkeypatch) -> None:
    port = free_port()
    monkeypatch.setenv("STALLFREE_OPERATOR_METRICS_PORT", str(port))
    daemon_port = int(daemon.url.rsplit(":", 1)[1])
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "chat-admin-token", "namespace": NS},
              "stringData": {"token": ADMIN_TOKEN}}
    for url, body in ((f"/api/v1/namespaces/{NS}/secrets", secret),
                      (f"/api/v1/namespaces/{NS}/pods", daemon_pod("chat-abc", daemon_port))):
        response = await kmock.post(url, json=body)
        assert response.status in (200, 201), await response.text()
    with httpx.Client() as client:
        client.put(f"{daemon.url}/admin/tuning", json={"token_budget": 512}, headers=daemon.admin_headers)

    async with Operator(port):
        await create(kmock, service())
        # The tuner's first decision (the profile's budget for 80% of the TPOT SLO, under tokenBudget.max)
        # reaches the daemon over its admin API.
        def tuned() -> int:
            return httpx.get(f"{daemon.url}/admin/tuning", headers=daemon.admin_headers).json()["token_budget"]

        budget = await eventually(lambda: tuned() != 512 and tuned(), timeout=20)
        assert budget <= 1024
        control = await eventually(lambda: obj(kmock, IS_RESOURCE, "chat")["status"]["control"], timeout=10)
        replica = control["replicas"][0]
        assert replica["name"] == "chat-abc" and replica["desiredTokenBudget"] == budget
        assert control["scaling"]["current"] == 1
        slo = await eventually(lambda: condition(kmock, "chat", "SLOMet")["reason"] != "AwaitingObservation"
                               and condition(kmock, "chat", "SLOMet"), timeout=20)
        assert slo["status"] in ("True", "False", "Unknown") and slo["message"]
        assert condition(kmock, "chat", "PrefillCapacityExhausted")["reason"] != "AwaitingObservation"
        # Feasibility from the daemon's measured profile: the llama-3-8b sim meets these SLOs, with the numbers.
        feasible = condition(kmock, "chat", "SLOFeasible")
        assert feasible["reason"] != "AwaitingObservation" and feasible["status"] in ("True", "Unknown")
        assert "feasibility" in obj(kmock, IS_RESOURCE, "chat")["status"]["control"]
        # The reconciler's conditions and the control loop's live side by side.
        await eventually(lambda: condition(kmock, "chat", "Ready") and condition(kmock, "chat", "SLOMet"), timeout=15)
        await another_step(kmock)  # the control loop writes its status again: the reconciler's conditions stay
        assert condition(kmock, "chat", "Ready") and condition(kmock, "chat", "Progressing")
        await eventually(lambda: events(kmock, "TuningInitialised"))
        await eventually(lambda: obj(kmock, IS_RESOURCE, "chat")["status"]["control"]["replicas"][0]["known"],
                         timeout=20)
        status = obj(kmock, IS_RESOURCE, "chat")["status"]
        assert status["tokenBudget"] == budget and status["p99TpotMs"] is not None

        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'stallfree_operator_desired_replicas{inferenceservice="chat",namespace="ns1"} 1.0' in text
        assert 'stallfree_operator_slo_p99_seconds{inferenceservice="chat",metric="tpot",namespace="ns1"} 0.05' in text
        assert 'stallfree_operator_decisions_total{inferenceservice="chat",kind="initial"' in text

    # A restarted operator resumes from status.control.state: no second start, the same tuning.
    initialised = len(events(kmock, "TuningInitialised"))
    steps_before = obj(kmock, IS_RESOURCE, "chat")["status"]["control"]["lastStepTime"]
    monkeypatch.setenv("STALLFREE_OPERATOR_METRICS_PORT", "0")
    async with Operator(0):
        resumed = await another_step(kmock, steps_before)
        await another_step(kmock, resumed)  # a wrong restart would have decided "initial" by its first step
    assert len(events(kmock, "TuningInitialised")) == initialised
    assert tuned() == budget


async def test_a_deleted_admin_secret_is_made_again_by_the_next_control_step(kmock: BridgedEmulator, daemon,
                                                                            monkeypatch) -> None:
    # Secrets are not watched (that takes list/watch on every Secret of the namespace); the control loop reads
    # the Secret at each step and, finding it gone, reconciles: the Secret is back within a step or two.
    monkeypatch.setenv("STALLFREE_OPERATOR_METRICS_PORT", "0")
    daemon_port = int(daemon.url.rsplit(":", 1)[1])
    response = await kmock.post(f"/api/v1/namespaces/{NS}/pods", json=daemon_pod("chat-abc", daemon_port))
    assert response.status in (200, 201), await response.text()
    async with Operator(0):
        await create(kmock, service())
        secret = await eventually(lambda: obj(kmock, "v1/secrets", "chat-admin-token"), timeout=20)
        await another_step(kmock, await eventually(lambda: last_step(kmock), timeout=20))
        response = await kmock.delete(f"/api/v1/namespaces/{NS}/secrets/chat-admin-token")
        assert response.status == 200, await response.text()
        remade = await eventually(
            lambda: (new := obj(kmock, "v1/secrets", "chat-admin-token"))["metadata"]["uid"]
            != secret["metadata"]["uid"] and not kmock.objects["v1/secrets", NS, "chat-admin-token"].deleted and new,
            timeout=20)
        assert remade["stringData"]["token"] and remade["stringData"]["token"] != secret["stringData"]["token"]


async def test_a_scale_in_ranks_the_pods_the_scaler_chose_by_deletion_cost(kmock: BridgedEmulator) -> None:
    # The ReplicaSet removes the pods of the lowest controller.kubernetes.io/pod-deletion-cost first: the
    # scaler's removal order becomes those costs (the first the lowest), a pod already gone is skipped.
    from stallfree.operator.reconcile.k8s_actuator import DELETION_COST, mark_for_removal
    from stallfree.operator.reconcile.kube import Kube

    for name in ("chat-a", "chat-b", "chat-c"):
        response = await kmock.post(f"/api/v1/namespaces/{NS}/pods", json=daemon_pod(name, 8000))
        assert response.status in (200, 201), await response.text()

    def mark() -> list[str]:
        kube = Kube.from_environment()
        try:
            return mark_for_removal(kube, NS, ["chat-b", "chat-gone", "chat-a"])
        finally:
            kube.close()

    assert await asyncio.to_thread(mark) == ["chat-b", "chat-a"]
    costs = {name: obj(kmock, "v1/pods", name)["metadata"].get("annotations", {}).get(DELETION_COST)
             for name in ("chat-a", "chat-b", "chat-c")}
    assert costs == {"chat-b": "-3", "chat-a": "-1", "chat-c": None}  # chat-c unnamed: cost 0, removed last
