"""The control loop's Kubernetes edge: which pods to observe, and acting on them.

- targets: the daemon pods of one InferenceService (by its selector), minus terminating ones; a pod is
  ready when its Ready condition is True; its address is podIP and the container port named `http`;
  its instance is uid plus restart count, so a container restart is seen as a new instance.
- put_tuning: PUT /admin/tuning on the pod with the service's admin token (from its Secret).
- set_replicas: /scale of the InferenceService (spec.replicas), exactly what an HPA would write; the
  reconciler carries it to the Deployment, whose preStop hook and grace period drain removed pods.
- prefer_removal: before a scale-in, each daemon pod's `controller.kubernetes.io/pod-deletion-cost` in the
  scaler's removal order (the first most negative), so the ReplicaSet removes the pods the scaler chose (the
  slowest, the not-ready) instead of its own pick (beta and on by default since Kubernetes 1.22).
- record_event: a Kubernetes Event on the InferenceService (kopf posts it).

The Kube client is synchronous: its calls run in a worker thread, off kopf's event loop.
"""
from __future__ import annotations

import asyncio
import base64
from typing import Any, Sequence

import httpx

from stallfree.contracts import Tuning
from stallfree.operator.reconcile import render
from stallfree.operator.reconcile.kube import Kube, KubeError
from stallfree.operator.control.observe import ReplicaTarget


def pod_target(pod: dict[str, Any]) -> ReplicaTarget | None:
    """The ReplicaTarget of one daemon pod; None for a pod being deleted (it drains, it is not a replica)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
    port = _http_port(pod)
    ip = status.get("podIP")
    url = f"http://{_host(ip)}:{port}" if ip else None
    restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or ())
    return ReplicaTarget(meta["name"], url=url, ready=ready and url is not None,
                         instance=f"{meta.get('uid', '')}/{restarts}")


def _http_port(pod: dict[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return render.DAEMON_PORT


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def replica_targets(kube: Kube, namespace: str, name: str) -> list[ReplicaTarget]:
    pods = kube.list("v1", "Pod", namespace, render.selector_string(name))
    targets = [pod_target(pod) for pod in pods]
    return sorted((t for t in targets if t is not None), key=lambda t: t.name)


def router_urls(kube: Kube, namespace: str, name: str) -> list[str]:
    """The ready router pods of one InferenceService: each keeps its own queue, the control loop reads all."""
    selector = render.router_selector_labels(name)
    pods = kube.list("v1", "Pod", namespace, ",".join(f"{k}={v}" for k, v in sorted(selector.items())))
    urls = []
    for pod in pods:
        if not selector.items() <= ((pod.get("metadata") or {}).get("labels") or {}).items():
            continue  # the server filters already; a daemon's address must never be read as a router's
        target = pod_target(pod)
        if target is not None and target.ready and target.url:
            urls.append(target.url)
    return sorted(urls)


def read_admin_token(kube: Kube, namespace: str, name: str) -> str | None:
    """The service's admin token from the Secret the reconciler made (None while it does not exist)."""
    secret = kube.get("v1", "Secret", namespace, render.admin_secret_name(name))
    if secret is None:
        return None
    if (secret.get("stringData") or {}).get(render.ADMIN_TOKEN_KEY):
        return secret["stringData"][render.ADMIN_TOKEN_KEY]
    encoded = (secret.get("data") or {}).get(render.ADMIN_TOKEN_KEY)
    return base64.b64decode(encoded).decode() if encoded else None


DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def mark_for_removal(kube: Kube, namespace: str, pods: Sequence[str]) -> list[str]:
    """Rank `pods` for the next scale-in: the first gets the lowest deletion cost (-len(pods)), the last -1;
    pods not named keep theirs (0 when never marked), so they go after these. A pod already gone is skipped.
    Returns the pods marked."""
    marked = []
    for rank, pod in enumerate(pods):
        cost = str(rank - len(pods))
        try:
            kube.patch("v1", "Pod", namespace, pod, {"metadata": {"annotations": {DELETION_COST: cost}}})
        except KubeError as exc:
            if exc.status != 404:
                raise
            continue
        marked.append(pod)
    return marked


class TuningRejected(RuntimeError):
    """A daemon answered the PUT with an error (its message says why)."""


class KubernetesActuator:
    def __init__(self, kube: Kube, owner: dict[str, Any], client: httpx.AsyncClient, admin_token: str | None,
                 targets: list[ReplicaTarget], timeout_s: float = 3.0) -> None:
        self.kube = kube
        self.owner = owner
        self.client = client
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.urls = {t.name: t.url for t in targets}
        self.timeout_s = timeout_s

    @property
    def namespace(self) -> str:
        return self.owner["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.owner["metadata"]["name"]

    async def put_tuning(self, replica: str, tuning: Tuning) -> None:
        url = self.urls.get(replica)
        if url is None:
            raise TuningRejected(f"{replica} has no address")
        response = await self.client.put(f"{url}/admin/tuning", json=tuning.to_dict(), headers=self.headers,
                                         timeout=self.timeout_s)
        if response.status_code != 200:
            raise TuningRejected(f"{replica} answered {response.status_code}: {response.text[:300]}")

    async def prefer_removal(self, replicas: Sequence[str]) -> None:
        await asyncio.to_thread(mark_for_removal, self.kube, self.namespace, replicas)

    async def set_replicas(self, replicas: int) -> None:
        await asyncio.to_thread(self.kube.scale_service, self.namespace, self.name, replicas)

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None:
        import kopf

        (kopf.warn if warning else kopf.info)(self.owner, reason=reason, message=message[:1000])
