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
# Everything the ClusterRole may name: the operator's own resource, and kopf's read-only discovery.
OWN = {("serving.stallfree.io", r) for r in ("inferenceservices", "inferenceservices/status",
                                             "inferenceservices/scale", "inferenceservices/finalizers")}
READ = {"get", "list", "watch"}


def granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def operator_calls(kmock: BridgedEmulator, cluster_wide: bool) -> set[tuple[str, str, str]]:
    """The operator's requests as RBAC rights: those without a namespace in their path (cluster_wide), or
    those inside one."""
    calls = set()
    for request in kmock._requests:
        if request.resource is None or not request.resource.plural \
                or request.headers.get("User-Agent", "").startswith("kmock"):
            continue  # discovery, or the test acting as a user
        if (request.namespace is None) != cluster_wide:
            continue
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        calls.add((request.resource.group, resource, rbac_verb(request)))
    return calls


def test_the_cluster_role_names_only_the_operators_resource_and_discovery() -> None:
    """A ClusterRoleBinding reaches every namespace: only inferenceservices may be written there, and only
    kopf's discovery read besides. Deployments, pods, Secrets and RBAC objects would make it cluster-admin."""
    for group, resource, verb in granted(CLUSTER_WIDE):
        assert "*" not in (group, resource, verb)
        if (group, resource) not in OWN:
            assert (group, resource) == ("apiextensions.k8s.io", "customresourcedefinitions") and verb in READ, \
                (group, resource, verb)
    binding = yaml.safe_load((OPERATOR / "clusterrolebinding.yaml").read_text())
    assert binding["roleRef"]["name"] == CLUSTER_WIDE["metadata"]["name"]  # the namespaced role: no cluster binding
    per_namespace = yaml.safe_load((OPERATOR / "namespaced" / "rolebinding.yaml").read_text())
    assert per_namespace["kind"] == "RoleBinding" and "namespace" not in per_namespace["metadata"]
    assert per_namespace["roleRef"]["name"] == NAMESPACED["metadata"]["name"]
    assert per_namespace["subjects"] == binding["subjects"]
    kustomization = yaml.safe_load((OPERATOR / "kustomization.yaml").read_text())
    assert "namespaced/rolebinding.yaml" not in kustomization["resources"]


class Operator:
    """The reconciler under kopf, run as deployed (--all-namespaces); the control loop's calls are made below
    through its own functions (its kopf timer is exercised in tests/test_control_handlers.py)."""

    def __init__(self) -> None:
        self.runner = kopf.testing.KopfRunner(["run", "--standalone", "--all-namespaces"],
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
    for kind in ("ServiceMonitor", "PrometheusRule"):
        kmock.resources[f"monitoring.coreos.com/v1/{kind.lower()}s"] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs={"get", "list", "create", "patch", "delete"})
    async with Operator():
        await create(kmock, manifest(tuning={"intervalSeconds": 1}))
        await eventually(lambda: exists(kmock, "monitoring.coreos.com/v1/servicemonitors", "chat")
                         and exists(kmock, "monitoring.coreos.com/v1/prometheusrules", "chat")
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

    cluster_wide, in_namespace = operator_calls(kmock, cluster_wide=True), operator_calls(kmock, cluster_wide=False)
    assert cluster_wide and in_namespace
    assert not cluster_wide - granted(CLUSTER_WIDE), \
        f"called across namespaces without a cluster-wide right: {sorted(cluster_wide - granted(CLUSTER_WIDE))}"
    rules = granted(CLUSTER_WIDE) | granted(NAMESPACED)
    assert not in_namespace - rules, f"called without a right: {sorted(in_namespace - rules)}"
    unused = rules - cluster_wide - in_namespace - set(NEEDED_WITHOUT_A_CALL)
    assert not unused, f"granted but never called (remove, or say why in NEEDED_WITHOUT_A_CALL): {sorted(unused)}"
