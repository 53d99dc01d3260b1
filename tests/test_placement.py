"""Placement and the router's availability, as rendered: replicas pack by their requests (GPUs) with a
soft spread, one per node only when asked; two routers with a PDB and a preStop pause; the pod fields the
spec passes on (model volume, tolerations) are typed, so a bad value is refused by the schema."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from stallfree.operator.api import crd
from stallfree.operator.api import spec as s
from stallfree.operator.reconcile import render


def objects(spec: dict) -> dict[tuple[str, str], dict]:
    parsed = s.parse_spec(spec)
    return {(c["kind"], c["metadata"]["name"]): c for c in
            render.children("chat", "ns", parsed, render.StartupKnobs.from_spec(parsed), with_service_monitor=False)}


def daemon_pod(spec: dict) -> dict:
    return objects(spec)["Deployment", "chat"]["spec"]["template"]["spec"]


def test_gpu_replicas_pack_and_spread_softly() -> None:
    pod = daemon_pod({"engine": {"device": "cuda"}, "resources": {"limits": {"nvidia.com/gpu": 1}}})
    assert "affinity" not in pod  # nothing forbids a second daemon on an 8-GPU node
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert {c["whenUnsatisfiable"] for c in pod["topologySpreadConstraints"]} == {"ScheduleAnyway"}
    assert all(c["labelSelector"]["matchLabels"] == render.selector_labels("chat")
               for c in pod["topologySpreadConstraints"])


def test_one_per_node_when_asked() -> None:
    pod = daemon_pod({"placement": {"onePerNode": True}})
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {"labelSelector": {"matchLabels": render.selector_labels("chat")}, "topologyKey": "kubernetes.io/hostname"}]
    assert render.template_hash(s.parse_spec({"placement": {"onePerNode": True}})) != render.template_hash(
        s.parse_spec({}))  # placement is in the pod template: changing it rolls the daemons


def test_two_routers_a_pdb_and_a_pre_stop_pause() -> None:
    out = objects({})
    router = out["Deployment", "chat-router"]
    assert router["spec"]["replicas"] == 2
    pod = router["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(render.PRESTOP_SLEEP_S)]
    assert pod["terminationGracePeriodSeconds"] > render.PRESTOP_SLEEP_S
    assert pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"] == render.router_selector_labels("chat")
    pdb = out["PodDisruptionBudget", "chat-router"]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": render.router_selector_labels("chat")}}
    assert ("policy/v1", "PodDisruptionBudget", "chat-router") in render.router_children_refs("chat")
    assert ("PodDisruptionBudget", "chat-router") not in objects({"routing": {"mode": "service"}})


@pytest.mark.parametrize("volume, message", [
    ({"hostPath": {"path": "/"}}, "hostPath"),
    ({"persistentVolumeClaim": {"claimName": "a"}, "nfs": {"server": "n", "path": "/m"}}, "exactly one source"),
    ({}, "exactly one source"),
    ({"persistentVolumeClaim": {"claimName": "a", "readOnly": False}}, "readOnly"),
])
def test_a_model_volume_names_exactly_one_allowed_source(volume: dict, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        s.parse_spec({"model": {"source": "hf-folder", "path": "/models/x", "volume": volume}})
    assert message in s.spec_errors(err.value) or message in str(err.value)


def test_model_volumes_render_read_only() -> None:
    for volume, expected in (
            ({"persistentVolumeClaim": {"claimName": "llama"}}, {"persistentVolumeClaim": {"claimName": "llama",
                                                                                            "readOnly": True}}),
            ({"nfs": {"server": "nas", "path": "/models"}}, {"nfs": {"server": "nas", "path": "/models",
                                                                     "readOnly": True}}),
            ({"image": {"reference": "reg/llama:1"}}, {"image": {"reference": "reg/llama:1",
                                                                "pullPolicy": "IfNotPresent"}})):
        pod = daemon_pod({"model": {"source": "hf-folder", "path": "/models/x", "volume": volume}})
        assert {"name": "model", **expected} in pod["volumes"]


def test_tolerations_are_typed() -> None:
    pod = daemon_pod({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]})
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    for bad in ({"operator": "Sometimes"}, {"effect": "NoWay"}, {"key": "k", "colour": "red"}):
        with pytest.raises(ValidationError):
            s.parse_spec({"tolerations": [bad]})


@pytest.mark.parametrize("volume", [{"hostPath": {"path": "/"}},
                                    {"persistentVolumeClaim": {"claimName": "a"}, "nfs": {"server": "n", "path": "/m"}}])
def test_the_api_server_refuses_a_bad_model_volume(volume: dict) -> None:
    from test_crd import admission_errors  # the CRD's schema and CEL rules, as the API server applies them

    manifest = {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": "x"},
                "spec": {"model": {"source": "hf-folder", "path": "/models/x", "volume": volume}}}
    errors = admission_errors(manifest)
    assert errors and any("exactly one source" in e or "Additional properties" in e for e in errors), errors
    ok = {**manifest, "spec": {"model": {**manifest["spec"]["model"],
                                         "volume": {"persistentVolumeClaim": {"claimName": "a"}}}}}
    assert admission_errors(ok) == []


def test_the_api_server_refuses_a_bad_toleration() -> None:
    from test_crd import admission_errors

    manifest = {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": "x"},
                "spec": {"tolerations": [{"key": "k", "operator": "Sometimes"}]}}
    assert admission_errors(manifest)


def test_affinity_is_typed_to_its_three_kinds() -> None:
    # Issue 31: affinity was free-form, so a misspelt kind or a wrong shape was a 422 on the Deployment.
    crd_affinity = crd.custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"]["spec"]["properties"]["affinity"]
    assert sorted(crd_affinity["properties"]) == ["nodeAffinity", "podAffinity", "podAntiAffinity"]
    assert "x-kubernetes-preserve-unknown-fields" not in crd_affinity  # unknown kinds are pruned, not passed on
    with pytest.raises(ValidationError):
        s.parse_spec({"affinity": {"nodeAfinity": {}}})
    term = {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": "kubernetes.io/hostname"}
    pod = daemon_pod({"affinity": {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 10, "podAffinityTerm": term}]}}})
    assert pod["affinity"] == {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 10, "podAffinityTerm": term}]}}
