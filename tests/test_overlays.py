"""The kustomize base and overlays a user applies, built by `kubectl kustomize`: a registry and tag that move the
operator and every image it renders, monitoring on for kube-prometheus-stack (release label, dashboard
ConfigMap), the operator in a namespace of one's choice. tests/test_kubernetes_schemas.py validates them."""
from __future__ import annotations

import json
import pathlib
import subprocess

import pytest
import yaml

from stallfree.operator.reconcile import images
from test_kubernetes_schemas import kubectl

ROOT = pathlib.Path(__file__).resolve().parents[1]
OVERLAYS = ROOT / "manifests" / "overlays"

pytestmark = pytest.mark.skipif(kubectl() is None,
                                reason="kubectl (for `kubectl kustomize`; .ci/run installs it) is needed")


def build(folder: pathlib.Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def operator_container(objects: list[dict]) -> dict:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_the_base_names_the_default_images() -> None:
    container = operator_container(build(ROOT / "manifests" / "operator"))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == images.CONTROL_PLANE_IMAGE
    assert env[images.SERVING_IMAGE_ENV] == images.SERVING_IMAGE
    assert env[images.SERVING_CUDA_IMAGE_ENV] == images.SERVING_CUDA_IMAGE


def test_a_registry_overlay_moves_the_operator_and_what_it_renders() -> None:
    overlay = yaml.safe_load((OVERLAYS / "registry" / "kustomization.yaml").read_text())
    wanted = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in overlay["images"]}
    container = operator_container(build(OVERLAYS / "registry"))
    env = {e["name"]: e.get("value") for e in container["env"]}
    control_plane, serving, cuda = (wanted[image.rpartition(":")[0]] for image in (
        images.CONTROL_PLANE_IMAGE, images.SERVING_IMAGE, images.SERVING_CUDA_IMAGE))
    assert container["image"] == control_plane
    assert env[images.CONTROL_PLANE_IMAGE_ENV] == control_plane  # the routers it renders
    assert env[images.SERVING_IMAGE_ENV] == serving  # the daemons it renders
    assert env[images.SERVING_CUDA_IMAGE_ENV] == cuda
    assert env["HOME"] == "/tmp"  # other values untouched


def test_kube_prometheus_stack_overlay_labels_the_monitoring_for_the_release() -> None:
    objects = build(OVERLAYS / "kube-prometheus-stack")
    kinds = {o["kind"] for o in objects}
    assert {"PodMonitor", "PrometheusRule", "ConfigMap", "Deployment"} <= kinds
    # The daemons and routers are scraped by the ServiceMonitor the operator renders per service: a
    # cluster-wide one beside it would scrape every pod twice.
    assert "ServiceMonitor" not in kinds
    for obj in objects:
        if obj["kind"] in ("PodMonitor", "PrometheusRule"):
            assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack", obj["kind"]
            assert obj["metadata"]["namespace"] == "stallfree-system"
    (dashboard,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["grafana-dashboard.json"])["panels"]
    # Selectors are never relabelled (a Deployment's selector is immutable).
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert "release" not in deployment["spec"]["selector"]["matchLabels"]


def test_namespace_overlay_moves_the_operator_and_its_binding() -> None:
    objects = build(OVERLAYS / "namespace")
    target = yaml.safe_load((OVERLAYS / "namespace" / "kustomization.yaml").read_text())["namespace"]
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"} == {target}
    for obj in objects:
        if obj["kind"] in ("ServiceAccount", "Deployment", "Service"):
            assert obj["metadata"]["namespace"] == target, obj["kind"]
    (binding,) = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"][0]["namespace"] == target
