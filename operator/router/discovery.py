"""Replicas from the daemons' EndpointSlices (in a cluster): every address the Service selects, by pod.

Read with the pod's service-account token (RBAC: list endpointslices in its own namespace, nothing
else), read from its file at every poll: the kubelet rotates a projected token (bound tokens last about an
hour where their lifetime is not extended), and a token read once would stop discovery then. Addresses Kubernetes marks terminating are left out; readiness is the router's own poll, which
also catches the hung processes a readiness probe sees only after its failure threshold.
"""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Callable

import httpx

log = logging.getLogger("stallfree.router")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def replicas_from_slices(slices: list[dict[str, Any]], port_name: str = "http") -> dict[str, str]:
    """name -> base URL of each non-terminating endpoint (pure; the shape of discovery.k8s.io/v1)."""
    urls: dict[str, str] = {}
    for item in slices:
        ports = [p for p in item.get("ports") or [] if p.get("name") == port_name] or (item.get("ports") or [])
        if not ports or ports[0].get("port") is None:
            continue
        port = ports[0]["port"]
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("terminating"):
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            host = addresses[0]
            name = (endpoint.get("targetRef") or {}).get("name") or host
            host = f"[{host}]" if ":" in host else host
            urls[name] = f"http://{host}:{port}"
    return dict(sorted(urls.items()))


class EndpointSliceDiscovery:
    """Polls the slices of one Service every `interval_s` and hands the replica set to `apply`."""

    def __init__(self, service: str, namespace: str | None, apply: Callable[[dict[str, str]], None],
                 interval_s: float = 2.0, port_name: str = "http", api_server: str | None = None,
                 token: str | None = None, ca_file: str | bool | None = None,
                 token_file: Path = SA_DIR / "token") -> None:
        self.service = service
        self.namespace = namespace or _read(SA_DIR / "namespace") or "default"
        self.apply = apply
        self.interval_s = interval_s
        self.port_name = port_name
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.api_server = api_server or (f"https://{host}:{port}" if host else None)
        if self.api_server is None:
            raise ValueError("not in a cluster (no KUBERNETES_SERVICE_HOST): pass --replicas or --api-server")
        self.token, self.token_file = token, token_file  # a token given is used as it is; else the file's
        self.verify = ca_file if ca_file is not None else (str(SA_DIR / "ca.crt") if (SA_DIR / "ca.crt").exists()
                                                            else True)
        self.last: dict[str, str] | None = None

    def headers(self) -> dict[str, str]:
        """The Authorization header with the token as it is now."""
        token = self.token if self.token is not None else _read(self.token_file)
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def run(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        url = f"{self.api_server}/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
        params = {"labelSelector": f"kubernetes.io/service-name={self.service}"}
        async with httpx.AsyncClient(verify=self.verify, timeout=5.0, transport=transport) as client:
            while True:
                try:
                    response = await client.get(url, params=params, headers=self.headers())
                    response.raise_for_status()
                    replicas = replicas_from_slices(response.json().get("items") or [], self.port_name)
                    if replicas != self.last:
                        log.info("replicas of %s/%s: %s", self.namespace, self.service, ", ".join(replicas) or "none")
                        self.last = replicas
                        self.apply(replicas)
                except (httpx.HTTPError, ValueError) as exc:
                    # Keep the last known set: an API-server hiccup must not empty the router.
                    log.warning("listing EndpointSlices of %s failed: %s", self.service, exc)
                await asyncio.sleep(self.interval_s)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
