"""The operator's manifests: they build, and the Deployment runs the operator the way run_cli serves it."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import yaml

from stallfree.cli import operator as run_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPERATOR = ROOT / "manifests" / "operator"


def documents(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_kustomization_lists_files_that_exist_and_parse() -> None:
    kustomization = documents(OPERATOR / "kustomization.yaml")[0]
    kinds = []
    for entry in kustomization["resources"]:
        target = OPERATOR / entry
        files = [target / "inferenceservice.yaml"] if target.is_dir() else [target]
        for file in files:
            kinds += [d["kind"] for d in documents(file)]
    assert sorted(kinds) == sorted(["CustomResourceDefinition", "Namespace", "ServiceAccount", "ClusterRole",
                                    "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds_the_operator_bundle() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(OPERATOR)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    names = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout) if d}
    assert ("CustomResourceDefinition", "inferenceservices.serving.stallfree.io") in names
    assert ("Deployment", "stallfree-operator") in names


def test_operator_deployment_matches_its_command_line() -> None:
    deployment = documents(OPERATOR / "deployment.yaml")[0]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # standalone kopf: never two at once
    assert pod["serviceAccountName"] == documents(OPERATOR / "serviceaccount.yaml")[0]["metadata"]["name"]
    command = container["command"]
    assert command[:2] == ["stallfree", "operator"]
    args = run_cli.build_parser().parse_args(command[2:])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.liveness_port == ports["health"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    binding = documents(OPERATOR / "clusterrolebinding.yaml")[0]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    assert binding["roleRef"]["name"] == documents(OPERATOR / "clusterrole.yaml")[0]["metadata"]["name"]


def test_reconcile_only_loads_the_reconciler() -> None:
    assert run_cli.load_handlers(with_control_loop=False) == ["stallfree.operator.reconcile.handlers"]
