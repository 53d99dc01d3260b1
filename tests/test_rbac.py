"""Least privilege, from both sides: the operator's RBAC is exactly what its code calls (plus the few
rights Kubernetes needs without a call, each with its reason), and nothing dangerous is cluster-wide.

The real reconciler (under kopf) runs against kmock through a service's whole life: made with a
ServiceMonitor API present, children deleted by hand and repaired, switched to a plain Service, deleted;
the control loop's API calls (its pods, routers, admin token, status, deletion costs, /scale) are made
through its own functions with the same client. Every request is mapped to the RBAC (apiGroup, resource,
verb) it needs.
"""
from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import kopf.testing
import pytest
import yaml

from kmock_bridge import BridgedEmulator
from stallfree.operator.api import spec as s
from stallfree.operator.reconcile import render
from stallfree.operator.reconcile.k8s_actuator import mark_for_removal, read_admin_token, replica_targets, router_urls
from stallfree.operator.reconcile.kube import Kube
from test_operator_kmock import (DEPLOYMENTS, IS_RESOURCE, IS_URL, NS, create, eventually, exists, kubeconfig,  # noqa: F401
                                 manifest, obj, patch_spec, rbac_verb, reconciler_registry)

pytestmark = [pytest.mark.kmock(cls=BridgedEmulator),
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]

OPERATOR = pathlib.Path(__file__).resolve().parents[1] / "manifests" / "operator"
CLUSTER_WIDE = yaml.safe_load((OPERATOR / "clusterrole.yaml").read_text())
NAMESPACED = yaml.safe_load((OPERATOR / "namespaced" / "clusterrole.yaml").read_text())
# Rights no request of the operator shows, and why it holds them.
NEEDED_WITHOUT_A_CALL = {
    ("serving.stallfree.io", "inferenceservices/finalizers", "update"):
        "children's ownerReferences set blockOwnerDeletion: OwnerReferencesPermissionEnforcement checks it",
    ("discovery.k8s.io", "endpointslices", "list"):
        "the router's Role grants it, and RBAC lets the operator grant only what it holds",
}
NEVER_CLUSTER_WIDE = {("", "secrets"), ("", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
                      ("rbac.authorization.k8s.io", "rolebindings"), ("rbac.authorization.k8s.io", "clusterroles"),
                      ("rbac.authorization.k8s.io", "clusterrolebindings")}


def granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def operator_calls(kmock: BridgedEmulator) -> set[tuple[str, str, str]]:
    calls = set()
    for request in kmock._requests:
        if request.resource is None or not request.resource.plural \
                or request.headers.get("User-Agent", "").startswith("kmock"):
            continue  # discovery, or the test acting as a user
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        calls.add((request.resource.group, resource, rbac_verb(request)))
    return calls


def test_secrets_and_rbac_objects_are_granted_only_per_namespace() -> None:
    cluster_wide = {(group, resource) for group, resource, _ in granted(CLUSTER_WIDE)}
    assert not cluster_wide & NEVER_CLUSTER_WIDE, cluster_wide & NEVER_CLUSTER_WIDE
    assert any(w in {"*"} for _, _, w in granted(CLUSTER_WIDE)) is False
    binding = yaml.safe_load((OPERATOR / "clusterrolebinding.yaml").read_text())
    assert binding["roleRef"]["name"] == CLUSTER_WIDE["metadata"]["name"]  # the namespaced role: no cluster binding
    per_namespace = yaml.safe_load((OPERATOR / "namespaced" / "rolebinding.yaml").read_text())
    assert per_namespace["kind"] == "RoleBinding" and "namespace" not in per_namespace["metadata"]
    assert per_namespace["roleRef"]["name"] == NAMESPACED["metadata"]["name"]
    assert per_namespace["subjects"] == binding["subjects"]
    kustomization = yaml.safe_load((OPERATOR / "kustomization.yaml").read_text())
    assert "namespaced/rolebinding.yaml" not in kustomization["resources"]


class Operator:
    """The reconciler under kopf; the control loop's calls are made below through its own functions (its kopf
    timer is exercised in tests/test_control_handlers.py)."""

    def __init__(self) -> None:
        self.runner = kopf.testing.KopfRunner(["run", "--standalone", "--namespace", NS],
                                              registry=reconciler_registry(), timeout=30)

    async def __aenter__(self) -> "Operator":
        self.runner.__enter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.runner.__exit__, None, None, None)
        assert self.runner.exit_code == 0, self.runner.output


def control_loop_calls(owner: dict[str, Any]) -> None:
    """What one control step asks of the API server (control_handlers.control_step), and the scaler's write."""
    kube = Kube.from_environment()
    try:
        replica_targets(kube, NS, "chat")
        router_urls(kube, NS, "chat")
        assert read_admin_token(kube, NS, "chat")
        kube.update_status(NS, "chat", {"p99TpotMs": 1.0})
        mark_for_removal(kube, NS, ["chat-daemon-gone"])  # before a scale-in (a pod already gone is skipped)
        kube.scale_service(NS, "chat", 2)
    finally:
        kube.close()


async def delete_and_wait_for_repair(kmock: BridgedEmulator, path: str, resource: str, name: str) -> None:
    uid = obj(kmock, resource, name)["metadata"]["uid"]
    response = await kmock.delete(f"{path}/{name}")
    assert response.status == 200, await response.text()
    await eventually(lambda: exists(kmock, resource, name) and obj(kmock, resource, name)["metadata"]["uid"] != uid,
                     timeout=30)


async def test_the_rules_are_what_the_operator_calls(kmock: BridgedEmulator) -> None:
    kmock.resources["monitoring.coreos.com/v1/servicemonitors"] = kmock.ResourceInfo(
        kind="ServiceMonitor", namespaced=True, verbs={"get", "list", "create", "patch", "delete"})
    async with Operator():
        await create(kmock, manifest(tuning={"intervalSeconds": 1}))
        await eventually(lambda: exists(kmock, "monitoring.coreos.com/v1/servicemonitors", "chat")
                         and exists(kmock, "rbac.authorization.k8s.io/v1/rolebindings", "chat-router"))
        await asyncio.to_thread(control_loop_calls, obj(kmock, IS_RESOURCE, "chat"))
        # Children deleted by hand come back without a spec change (the admin Secret is not watched: that
        # would take cluster-wide Secret rights; the control loop's step makes it again, repair_children).
        for path, resource, name in ((f"/api/v1/namespaces/{NS}/services", "v1/services", "chat-daemons"),
                                     (f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets",
                                      "policy/v1/poddisruptionbudgets", "chat"),
                                     (f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets",
                                      "policy/v1/poddisruptionbudgets", "chat-router"),
                                     (f"/apis/apps/v1/namespaces/{NS}/deployments", DEPLOYMENTS, "chat-router")):
            await delete_and_wait_for_repair(kmock, path, resource, name)
        await patch_spec(kmock, "chat", {"routing": {"mode": "service"}})
        await eventually(lambda: not exists(kmock, "rbac.authorization.k8s.io/v1/roles", "chat-router"))
        response = await kmock.delete(f"{IS_URL}/chat")
        assert response.status == 200
        await eventually(lambda: not exists(kmock, IS_RESOURCE, "chat"), timeout=30)

    calls = operator_calls(kmock)
    rules = granted(CLUSTER_WIDE) | granted(NAMESPACED)
    assert not calls - rules, f"called without a right: {sorted(calls - rules)}"
    unused = rules - calls - set(NEEDED_WITHOUT_A_CALL)
    assert not unused, f"granted but never called (remove, or say why in NEEDED_WITHOUT_A_CALL): {sorted(unused)}"

    # kopf's watches of the children ask the API server for the operator's objects only.
    for plural in ("deployments", "services", "poddisruptionbudgets"):
        watches = [r for r in kmock._requests if r.resource is not None and r.resource.plural == plural
                   and r.method == "GET" and r.name is None
                   and not r.headers.get("User-Agent", "").startswith("kmock")
                   and (r.params.get("watch") in ("true", "1") or "kopf" in r.headers.get("User-Agent", ""))]
        assert watches, plural
        assert all(r.params.get("labelSelector") == f"{render.LABEL_MANAGED_BY}={render.MANAGED_BY}"
                   for r in watches), plural
