"""The daemons' NetworkPolicy, evaluated as a NetworkPolicy implementation would on the rendered pods: under
slo-aware routing the daemon port takes the service's own routers, the operator and Prometheus, and no other pod
(no way past the router's doors, shedding and fairness); in service routing the daemons are the front door."""
from __future__ import annotations

from typing import Any

import pytest
import yaml

from prometheus_targets import pods_of
from stallfree.operator.api import spec as s
from stallfree.operator.reconcile import render
from test_alert_rules import ROOT

NS = "serving"


def rendered(name: str, mode: str) -> list[dict[str, Any]]:
    spec = s.parse_spec({"routing": {"mode": mode}})
    return render.children(name, NS, spec, render.StartupKnobs.from_spec(spec), with_service_monitor=True)


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def admits(policy: dict[str, Any], source: dict[str, Any], source_ns_labels: dict[str, str], port: int) -> bool:
    """Whether `policy` lets `source` (a pod) reach its pods on `port` (the semantics of networking.k8s.io/v1)."""
    for rule in policy["spec"].get("ingress") or []:
        if rule.get("ports") and not any(p["port"] == port for p in rule["ports"]):
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        for peer in peers:
            in_namespace = (matches(peer["namespaceSelector"], source_ns_labels) if "namespaceSelector" in peer
                            else source["metadata"]["namespace"] == policy["metadata"]["namespace"])
            if in_namespace and matches(peer.get("podSelector") or {}, source["metadata"]["labels"]):
                return True
    return False


def ns_labels(namespace: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace}


def pods(children: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    (deployment,) = [c for c in children if c["kind"] == "Deployment"
                     and c["spec"]["template"]["metadata"]["labels"][render.LABEL_COMPONENT] == component]
    return pods_of(deployment, 1)


def operator_pod() -> dict[str, Any]:
    deployment = yaml.safe_load((ROOT / "manifests" / "operator" / "deployment.yaml").read_text())
    return pods_of(deployment, 1)[0]


PROMETHEUS = {"metadata": {"name": "prometheus-0", "namespace": "monitoring",
                           "labels": {"app.kubernetes.io/name": "prometheus"}}}
STRANGER = {"metadata": {"name": "curl", "namespace": NS, "labels": {"app": "curl"}}}


@pytest.mark.parametrize("mode", ["slo-aware", "service"])
def test_the_policy_selects_the_daemons_only(mode: str) -> None:
    children = rendered("chat", mode)
    (policy,) = [c for c in children if c["kind"] == "NetworkPolicy"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert all(matches(policy["spec"]["podSelector"], p["metadata"]["labels"]) for p in pods(children, "daemon"))
    if mode == "slo-aware":
        assert not any(matches(policy["spec"]["podSelector"], p["metadata"]["labels"]) for p in pods(children, "router"))


def test_under_slo_aware_routing_only_its_routers_the_operator_and_prometheus_reach_the_daemons() -> None:
    chat, other = rendered("chat", "slo-aware"), rendered("other", "slo-aware")
    (policy,) = [c for c in chat if c["kind"] == "NetworkPolicy"]
    port = render.DAEMON_PORT
    assert admits(policy, pods(chat, "router")[0], ns_labels(NS), port)
    assert admits(policy, operator_pod(), ns_labels("stallfree-system"), port)
    assert admits(policy, PROMETHEUS, ns_labels("monitoring"), port)
    assert not admits(policy, STRANGER, ns_labels(NS), port)
    assert not admits(policy, pods(other, "router")[0], ns_labels(NS), port)  # another service's router
    assert not admits(policy, pods(other, "daemon")[0], ns_labels(NS), port)
    # The operator's labels from another namespace are not the operator.
    impostor = {"metadata": {**operator_pod()["metadata"], "namespace": NS}}
    assert not admits(policy, impostor, ns_labels(NS), port)
    assert not admits(policy, pods(chat, "router")[0], ns_labels(NS), render.PROBE_PORT)


def test_the_operators_namespace_follows_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(render.OPERATOR_NAMESPACE_ENV, "platform-llm")
    (policy,) = [c for c in rendered("chat", "slo-aware") if c["kind"] == "NetworkPolicy"]
    assert admits(policy, operator_pod(), ns_labels("platform-llm"), render.DAEMON_PORT)
    assert not admits(policy, operator_pod(), ns_labels("stallfree-system"), render.DAEMON_PORT)


def test_under_service_routing_the_daemons_are_the_front_door() -> None:
    (policy,) = [c for c in rendered("chat", "service") if c["kind"] == "NetworkPolicy"]
    assert admits(policy, STRANGER, ns_labels(NS), render.DAEMON_PORT)
    assert not admits(policy, STRANGER, ns_labels(NS), render.PROBE_PORT)
