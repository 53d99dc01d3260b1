"""`stallfree render -f FILE`: the objects the operator would create, as YAML, in either routing mode."""
from __future__ import annotations

import pathlib

import yaml

from stallfree.cli import render as render_cli
from stallfree.operator.reconcile import render

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "manifests" / "examples" / "smollm2-cpu.yaml"


def run(capsys, *argv: str) -> tuple[int, list[dict], str]:
    code = render_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, [d for d in yaml.safe_load_all(out) if d] if code == 0 else [], err


def test_prints_what_the_reconciler_applies(capsys) -> None:
    code, objects, _ = run(capsys, "-f", str(EXAMPLE), "-n", "serving")
    assert code == 0
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Service", name), ("Service", f"{name}-daemons"),
        ("ServiceAccount", f"{name}-router"), ("Role", f"{name}-router"), ("RoleBinding", f"{name}-router"),
        ("NetworkPolicy", name), ("PodDisruptionBudget", name), ("Deployment", name),
        ("PodDisruptionBudget", f"{name}-router"), ("Deployment", f"{name}-router"),
        ("ServiceMonitor", name), ("PrometheusRule", name)]
    assert {o["metadata"]["namespace"] for o in objects} == {"serving"}


def test_prints_no_secret_so_no_known_token_can_be_applied(capsys) -> None:
    """Piped into `kubectl apply`, the output must not deploy an admin token anyone can read: the operator makes
    the Secret itself, with a random token."""
    code, objects, _ = run(capsys, "-f", str(EXAMPLE))
    assert code == 0 and objects
    assert not [o for o in objects if o["kind"] == "Secret"]


def test_service_mode_without_a_monitor(capsys) -> None:
    code, objects, _ = run(capsys, "-f", str(EXAMPLE), "--routing-mode", "service", "--no-service-monitor")
    assert code == 0
    assert [o["kind"] for o in objects] == ["Service", "NetworkPolicy", "PodDisruptionBudget", "Deployment"]


def test_a_spec_the_operator_would_refuse_is_an_error(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"apiVersion": "serving.stallfree.io/v1alpha1", "kind": "InferenceService",
                                   "metadata": {"name": "bad"},
                                   "spec": {"model": {"source": "hf-folder", "path": "models/llama"}}}))
    code, _, err = run(capsys, "-f", str(bad))
    assert code == 1 and "must be an absolute path" in err
    bad.write_text(yaml.safe_dump({"apiVersion": "serving.stallfree.io/v1alpha1", "kind": "InferenceService",
                                   "metadata": {"name": "llama.3"}, "spec": {}}))
    code, _, err = run(capsys, "-f", str(bad))
    assert code == 1 and "DNS-1035" in err
    code, _, err = run(capsys, "-f", str(tmp_path / "missing.yaml"))
    assert code == 2 and "cannot read" in err
