"""The InferenceService CustomResourceDefinition, generated from the pydantic models in spec.py.

Pydantic writes JSON Schema; Kubernetes wants a *structural* OpenAPI v3 schema: no $ref, no
`additionalProperties: false`, no null branches, int-or-string spelled its own way, free-form objects
marked `x-kubernetes-preserve-unknown-fields`, object defaults of `{}` so nested defaults apply. This
module does that translation and adds the CEL rules from spec.RULES, the status and scale
subresources and the printer columns. `stallfree crd` prints the result; crds/ holds a copy.
"""
from __future__ import annotations

from typing import Any

import yaml

from stallfree.operator.api import spec as s

_DROP = {"title", "quantities"}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return {**target, **extra}
    return node


def _structural(node: dict[str, Any], defs: dict[str, Any], where: str) -> dict[str, Any]:
    node = _resolve(node, defs)
    if "anyOf" in node:
        branches = [_resolve(b, defs) for b in node["anyOf"] if b.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", 0) is None:
            del rest["default"]  # an optional field: absent, never null
        if len(branches) == 1:
            return _structural({**branches[0], **rest}, defs, where)
        if sorted(b.get("type") for b in branches) == ["integer", "string"]:
            out = {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}
            # Each branch's own limits (a quantity's pattern, an integer's minimum) apply to values of its type.
            for branch in branches:
                out.update({k: v for k, v in branch.items() if k in ("pattern", "minimum", "maxLength")})
            out.update({k: v for k, v in rest.items() if k not in _DROP})
            return out
        raise ValueError(f"{where}: no structural form for anyOf {branches}")

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key == "additionalProperties" and value is False:
            continue
        if key == "additionalProperties" and value is True:
            out["x-kubernetes-preserve-unknown-fields"] = True
        elif key == "properties":
            required = set(node.get("required", []))
            out["properties"] = {
                name: _property(name, prop, name in required, defs, f"{where}.{name}")
                for name, prop in value.items()
            }
        elif key == "additionalProperties":
            out[key] = _structural(value, defs, f"{where}.*")
        elif key == "items":
            out[key] = _structural(value, defs, f"{where}[]")
        elif key == "$defs":
            continue
        elif key == "const":  # a structural schema has no const: a one-value enum says the same
            out["enum"] = [value]
        else:
            out[key] = value
    if out.get("x-kubernetes-preserve-unknown-fields") and "type" not in out:
        out["type"] = "object"
    rules = [{"rule": r.cel, "message": r.message} for r in s.RULES if r.where == where and r.cel != "true"]
    if rules:
        out["x-kubernetes-validations"] = rules
    return _ordered(out)


_KEY_ORDER = ["type", "description", "default", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern"]


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Readable key order in the printed YAML: type and description first, children last."""
    rank = {key: i for i, key in enumerate(_KEY_ORDER)}
    late = {"required": 1, "properties": 2, "additionalProperties": 2, "items": 2, "x-kubernetes-validations": 3}
    return dict(sorted(node.items(), key=lambda kv: (late.get(kv[0], 0), rank.get(kv[0], len(rank)))))


def _property(name: str, prop: dict[str, Any], required: bool, defs: dict[str, Any], where: str) -> dict[str, Any]:
    out = _structural(prop, defs, where)
    # A sub-model with nothing required defaults to {} so the API server fills in its own defaults; an
    # optional one (`X | None`, such as model.volume) stays absent until the user writes it.
    optional = any(branch.get("type") == "null" for branch in prop.get("anyOf", ()))
    if not required and not optional and out.get("type") == "object" and "properties" in out \
            and "default" not in out and not _resolve(prop, defs).get("required"):
        out["default"] = {}
    return _ordered(out)


def spec_schema() -> dict[str, Any]:
    raw = s.InferenceServiceSpec.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}), "spec")


def status_schema() -> dict[str, Any]:
    raw = s.InferenceServiceStatus.model_json_schema(by_alias=True, mode="validation")
    out = _structural(raw, raw.get("$defs", {}), "status")
    conditions = out["properties"]["conditions"]
    conditions.pop("default", None)
    # Conditions are a map keyed by type: several writers (reconciler, control loop) each own their types.
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return out


def _condition_column(name: str, condition: str, priority: int = 0) -> dict[str, Any]:
    column = {"name": name, "type": "string", "jsonPath": f'.status.conditions[?(@.type=="{condition}")].status'}
    if priority:
        column["priority"] = priority
    return column


PRINTER_COLUMNS: list[dict[str, Any]] = [
    _condition_column("Ready", "Ready"),
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "Ready-Replicas", "type": "integer", "jsonPath": ".status.readyReplicas", "priority": 1},
    {"name": "Budget", "type": "integer", "jsonPath": ".status.tokenBudget"},
    {"name": "P99-TPOT-ms", "type": "number", "jsonPath": ".status.p99TpotMs"},
    {"name": "P99-TTFT-ms", "type": "number", "jsonPath": ".status.p99TtftMs"},
    {"name": "Goodput", "type": "number", "jsonPath": ".status.goodput", "priority": 1},
    _condition_column("SLO-Met", "SLOMet"),
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def openapi_schema() -> dict[str, Any]:
    """The whole object's schema (what `openAPIV3Schema` holds)."""
    return {
        "type": "object",
        "description": "An LLM served under latency SLOs by stall-free chunked-prefill daemons, "
                       "re-tuned live and scaled by the stallfree operator.",
        "required": ["spec"],
        "x-kubernetes-validations": [{"rule": s.NAME_CEL, "message": s.NAME_MESSAGE}],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
    }


def custom_resource_definition() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{s.PLURAL}.{s.GROUP}", "labels": {"app.kubernetes.io/part-of": "stallfree"}},
        "spec": {
            "group": s.GROUP,
            "scope": "Namespaced",
            "names": {"kind": s.KIND, "listKind": f"{s.KIND}List", "plural": s.PLURAL, "singular": s.SINGULAR,
                      "shortNames": list(s.SHORT_NAMES), "categories": ["stallfree"]},
            "versions": [{
                "name": s.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {
                    "status": {},
                    # HPA and KEDA drive spec.replicas through /scale; the selector finds the daemon pods.
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `stallfree crd` from operator/api/spec.py; do not edit by hand.\n"
    return header + yaml.safe_dump(custom_resource_definition(), sort_keys=False, width=120)
