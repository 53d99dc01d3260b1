"""Every object the operator would make for an InferenceService manifest, as `helm template` shows a chart's.

The same rendering the reconciler applies (render.py), from the same validation (spec.py, checks.py),
with what only a cluster knows made explicit: the namespace and whether the Prometheus Operator's API exists
(the ServiceMonitor and the SLO targets' PrometheusRule). The admin-token Secret is not shown: the operator
makes it with a random token, once, and the output piped into `kubectl apply` must not deploy a token that
anyone can read here. Owner references need the InferenceService's uid, which only the API server gives:
they are left out.
"""
from __future__ import annotations

from typing import Any

from stallfree.operator.api import checks
from stallfree.operator.api import spec as s
from stallfree.operator.reconcile import render

class InvalidManifest(ValueError):
    """A manifest the operator would refuse (its InvalidSpec condition says the same)."""


def preview(manifest: dict[str, Any], namespace: str | None = None, *, routing_mode: str | None = None,
            with_service_monitor: bool = True) -> list[dict[str, Any]]:
    """The children in the order the reconciler applies them (the admin Secret, made by the operator, aside)."""
    if manifest.get("kind") != s.KIND:
        raise InvalidManifest(f"not an {s.KIND}: kind {manifest.get('kind')!r}")
    meta = manifest.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise InvalidManifest(f"{s.KIND} without metadata.name")
    if (problem := s.name_problem(name)) is not None:
        raise InvalidManifest(f"{s.KIND} {problem}")
    namespace = namespace or meta.get("namespace") or "default"
    data = dict(manifest.get("spec") or {})
    if routing_mode:
        data["routing"] = {**(data.get("routing") or {}), "mode": routing_mode}
    try:
        spec = s.parse_spec(data)
    except Exception as exc:  # pydantic's ValidationError: every problem, one per line
        raise InvalidManifest(f"{s.KIND} {name}: invalid spec:\n{s.spec_errors(exc)}") from None
    problems = checks.problems(spec)
    if problems:
        raise InvalidManifest(f"{s.KIND} {name} cannot be served: " + "; ".join(problems))
    knobs = render.StartupKnobs.from_spec(spec)
    return render.children(name, namespace, spec, knobs, with_service_monitor=with_service_monitor,
                           with_slo_rule=with_service_monitor)
