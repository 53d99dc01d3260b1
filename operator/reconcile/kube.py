"""A thin, synchronous Kubernetes client for the operator: get, list, apply, patch, delete, idempotently.

It speaks plain JSON objects over the `kubernetes` package's authenticated REST client (in-cluster
service account or KUBECONFIG), so rendered dicts go out as they are, with no model classes between.
Children are applied with server-side apply (field manager `stallfree-operator`, forced): applying
the same object twice changes nothing, and fields the operator stops rendering are removed. A server
that answers an apply of a missing object with 404 gets a create instead.
"""
from __future__ import annotations

import json
import os
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from stallfree.operator.api import conditions as cond
from stallfree.operator.api import spec as s

FIELD_MANAGER = "stallfree-operator"
_TIMEOUT = (5.0, 30.0)  # connect, read
_PLURALS = {"Endpoints": "endpoints", "NetworkPolicy": "networkpolicies"}  # not lowercase + "s"


class KubeError(Exception):
    """An API call that failed, with the server's status code and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def plural_of(kind: str) -> str:
    return _PLURALS.get(kind, kind.lower() + "s")


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
                subresource: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}" if namespace else base
    path += f"/{plural_of(kind)}"
    if name:
        path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
    return path


def _ref(obj: dict[str, Any]) -> tuple[str, str, str | None, str]:
    meta = obj.get("metadata") or {}
    return obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]


def load_configuration() -> k8s_client.Configuration:
    """In a pod: its service account. Elsewhere: the cluster KUBECONFIG (or ~/.kube/config) names."""
    configuration = k8s_client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=configuration)
    else:
        # Read KUBECONFIG now: the kubernetes package fixed its default when it was imported.
        k8s_config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                    client_configuration=configuration, persist_config=False)
    return configuration


def contains(existing: Any, desired: Any) -> bool:
    """Whether `existing` already holds every field of `desired` (the server may add more)."""
    if isinstance(desired, dict):
        return isinstance(existing, dict) and all(k in existing and contains(existing[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(existing, list) and len(existing) == len(desired) and all(
            contains(e, d) for e, d in zip(existing, desired))
    return existing == desired


class Kube:
    def __init__(self, api_client: k8s_client.ApiClient) -> None:
        self._api = api_client

    @classmethod
    def from_environment(cls) -> "Kube":
        return cls(k8s_client.ApiClient(load_configuration()))

    @property
    def configuration(self) -> k8s_client.Configuration:
        return self._api.configuration

    def close(self) -> None:
        self._api.close()

    # -- raw REST ---------------------------------------------------------------------------------------
    def request(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
                query: dict[str, str] | None = None) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        method, url, headers, body, _ = self._api.param_serialize(
            method=method, resource_path=path, query_params=list((query or {}).items()), header_params=headers,
            body=body, auth_settings=["BearerToken"])
        response = self._api.call_api(method, url, header_params=headers, body=body, _request_timeout=_TIMEOUT)
        response.read()
        text = (response.data or b"").decode("utf-8", "replace")
        if not 200 <= response.status < 300:
            try:
                payload = json.loads(text)
                raise KubeError(response.status, payload.get("reason") or "", payload.get("message") or text)
            except ValueError:
                raise KubeError(response.status, response.reason or "", text) from None
        return json.loads(text) if text else {}

    # -- verbs ------------------------------------------------------------------------------------------
    def get(self, api_version: str, kind: str, namespace: str | None, name: str,
            subresource: str | None = None) -> dict[str, Any] | None:
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name, subresource))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None,
             label_selector: str | None = None) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        return list(self.request("GET", object_path(api_version, kind, namespace), query=query).get("items") or [])

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        api_version, kind, namespace, _ = _ref(obj)
        return self.request("POST", object_path(api_version, kind, namespace), body=obj)

    def create_if_absent(self, obj: dict[str, Any]) -> bool:
        """Create unless it exists (then leave it untouched). True when this call made it."""
        try:
            self.create(obj)
            return True
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: the object ends up with exactly the fields this manager renders."""
        api_version, kind, namespace, name = _ref(obj)
        try:
            return self.request("PATCH", object_path(api_version, kind, namespace, name), body=obj,
                                content_type="application/apply-patch+yaml",
                                query={"fieldManager": FIELD_MANAGER, "force": "true"})
        except KubeError as exc:
            if exc.status != 404:
                raise
        return self.create(obj)  # only servers without server-side apply get here

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        """JSON merge patch (RFC 7386): dicts merge, lists and scalars replace, null removes."""
        return self.request("PATCH", object_path(api_version, kind, namespace, name, subresource), body=patch,
                            content_type="application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete; True when it existed. Dependents go in the background (the garbage collector)."""
        try:
            self.request("DELETE", object_path(api_version, kind, namespace, name),
                         body={"propagationPolicy": "Background"})
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    def has_api(self, api_version: str, kind: str) -> bool:
        """Discovery: does this cluster serve `kind` at `api_version` (say, Prometheus Operator's)?"""
        path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            resources = self.request("GET", path).get("resources") or []
        except KubeError as exc:
            if exc.status in (404, 503):
                return False
            raise
        return any(r.get("name") == plural_of(kind) for r in resources)

    # -- InferenceService helpers -----------------------------------------------------------------------
    def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(s.API_VERSION, s.KIND, namespace, name)

    def scale_service(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set spec.replicas through /scale, as HPA would (managed scaling writes here too)."""
        return self.patch(s.API_VERSION, s.KIND, namespace, name, {"spec": {"replicas": int(replicas)}},
                          subresource="scale")

    def update_status(self, namespace: str, name: str, fields: dict[str, Any],
                      conditions: list[dict[str, Any]] = (), attempts: int = 5) -> dict[str, Any] | None:
        """Merge `fields` into status and `conditions` into its conditions, with optimistic concurrency.

        The patch carries the resourceVersion it was computed from, so a concurrent writer (the
        control loop, say) makes it fail with 409 and it is recomputed rather than lost. Skips the
        write when nothing would change. Returns the object, or None if it is gone.
        """
        for _ in range(max(1, attempts)):
            current = self.get_service(namespace, name)
            if current is None:
                return None
            status = current.get("status") or {}
            if all(status.get(k) == v for k, v in fields.items()) and not cond.changed(
                    status.get("conditions"), conditions):
                return current
            body: dict[str, Any] = {"status": dict(fields)}
            if conditions:
                body["status"]["conditions"] = cond.merge(status.get("conditions"), conditions)
            version = (current.get("metadata") or {}).get("resourceVersion")
            if version:
                body["metadata"] = {"resourceVersion": version}
            try:
                return self.patch(s.API_VERSION, s.KIND, namespace, name, body, subresource="status")
            except KubeError as exc:
                if exc.status != 409:
                    raise
        raise KubeError(409, "Conflict", f"status of {namespace}/{name} kept changing under {attempts} attempts")
