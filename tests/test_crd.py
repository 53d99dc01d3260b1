"""The InferenceService CRD: generated, structural, kept in crds/, and it admits the examples and
rejects broken manifests, each for its own reason.

Admission is replayed as the API server does it: schema defaults first, then the OpenAPI schema
(jsonschema), then the CEL rules (x-kubernetes-validations), evaluated by a small CEL-subset
evaluator below that understands exactly the constructs our rules use.
"""
from __future__ import annotations

import copy
import pathlib
import re
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from stallfree.operator.api import crd
from stallfree.operator.api import spec as s

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
SCHEMA = crd.openapi_schema()


# -- a CEL subset: member access, has(), type(), size(), matches(), string(), in, [i], a list's all(),
#    &&, ||, !, comparisons, + and integer / --------------------------------------------------------------

class CelError(Exception):
    """What CEL calls an evaluation error (a missing field, say): the rule rejects the object."""


class _Node:
    def __init__(self, value: dict[str, Any]) -> None:
        self._value = value

    def __getattr__(self, key: str) -> Any:
        if key not in self._value:
            raise CelError(f"no such key: {key}")
        return _wrap(self._value[key])

    def __getitem__(self, key: str) -> Any:
        return self.__getattr__(key)

    def __contains__(self, key: str) -> bool:
        return key in self._value


def _wrap(value: Any) -> Any:
    return _Node(value) if isinstance(value, dict) else value


def _has(node: Any, key: str) -> bool:
    return isinstance(node, _Node) and key in node._value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _matches(value: Any, pattern: str) -> bool:
    return isinstance(value, str) and re.search(pattern, value) is not None


def cel_to_python(rule: str) -> str:
    out = re.sub(r"^(\[[^\]]*\])\.all\((\w+), (.*)\)$", r"all((\3) for \2 in \1)", rule)
    out = re.sub(r"([\w.]+)\.matches\('([^']*)'\)", r"_matches(\1, r'\2')", out)
    out = re.sub(r"\bsize\(", "len(", out)
    out = re.sub(r"\bstring\(", "str(", out)
    out = re.sub(r"has\(([\w.]+)\.(\w+)\)", r"_has(\1, '\2')", out)
    out = re.sub(r"type\(([\w.]+)\) == string", r"isinstance(\1, str)", out)
    out = re.sub(r"type\(([\w.]+)\) == int", r"_is_int(\1)", out)
    out = out.replace("&&", " and ").replace("||", " or ").replace(" / ", " // ")
    out = re.sub(r"!(?!=)", " not ", out)
    return out


def cel_holds(rule: str, value: Any) -> bool:
    try:
        return bool(eval(cel_to_python(rule), {"_has": _has, "_is_int": _is_int, "_matches": _matches,
                                               "self": _wrap(value)}))  # globals: a comprehension sees them
    except (CelError, TypeError):
        return False


# -- admission as the API server does it ---------------------------------------------------------------

def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key in value:
            value[key] = apply_defaults(schema["additionalProperties"], value[key])
    elif isinstance(value, list) and "items" in schema:
        value[:] = [apply_defaults(schema["items"], item) for item in value]
    return value


def list_type_failures(schema: dict[str, Any], value: Any, where: str = "") -> list[str]:
    """x-kubernetes-list-type: the API server refuses a set with a duplicate, a map with a duplicate key."""
    failures = []
    if isinstance(value, list):
        if schema.get("x-kubernetes-list-type") == "set" and len({repr(v) for v in value}) != len(value):
            failures.append(f"{where}: Duplicate value")
        keys = schema.get("x-kubernetes-list-map-keys")
        if schema.get("x-kubernetes-list-type") == "map" and keys:
            seen = [tuple(item.get(k) for k in keys) for item in value]
            if len(set(seen)) != len(seen):
                failures.append(f"{where}: Duplicate value")
        for item in value:
            failures += list_type_failures(schema.get("items") or {}, item, f"{where}[]")
    elif isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                failures += list_type_failures(sub, value[key], f"{where}.{key}")
    return failures


def cel_failures(schema: dict[str, Any], value: Any) -> list[str]:
    failures = [rule["message"] for rule in schema.get("x-kubernetes-validations", [])
                if not cel_holds(rule["rule"], value)]
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                failures += cel_failures(sub, value[key])
    elif isinstance(value, list) and "items" in schema:  # rules on list items (tolerations) hold for each
        for item in value:
            failures += cel_failures(schema["items"], item)
    return failures


def admission_errors(manifest: dict[str, Any]) -> list[str]:
    """Every reason the API server would refuse this object (empty: admitted)."""
    obj = apply_defaults(SCHEMA, copy.deepcopy(manifest))
    errors = [e.message for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(obj)]
    return errors or list_type_failures(SCHEMA, obj) or cel_failures(SCHEMA, obj)


def load(path: pathlib.Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


# -- the CRD itself ----------------------------------------------------------------------------------------

def test_crds_folder_holds_the_generated_crd() -> None:
    assert (ROOT / "crds" / "inferenceservice.yaml").read_text() == crd.crd_yaml(), \
        "crds/inferenceservice.yaml is stale: run `stallfree crd -o crds/inferenceservice.yaml`"


def test_names_subresources_and_columns() -> None:
    definition = crd.custom_resource_definition()
    names = definition["spec"]["names"]
    assert (definition["spec"]["group"], names["kind"], names["plural"]) == (s.GROUP, s.KIND, s.PLURAL)
    assert "isvc" not in names["shortNames"] and names["shortNames"]
    version = definition["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    scale = version["subresources"]["scale"]
    assert version["subresources"]["status"] == {}
    props = SCHEMA["properties"]
    assert props["spec"]["properties"]["replicas"]["type"] == "integer" and scale["specReplicasPath"] == ".spec.replicas"
    assert props["status"]["properties"]["replicas"]["type"] == "integer"
    assert props["status"]["properties"]["selector"]["type"] == "string"
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert {"Ready", "Replicas", "Budget", "P99-TPOT-ms", "P99-TTFT-ms", "SLO-Met", "Age"} <= set(columns)
    for path in columns.values():  # simple paths name fields the schema has
        match = re.fullmatch(r"\.(spec|status)\.(\w+)(?:\.(\w+))?", path)
        if match:
            node = props[match[1]]["properties"][match[2]]
            assert match[3] is None or match[3] in node["properties"]


def _walk(node: dict[str, Any], where: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(where, node)]
    for key, sub in node.get("properties", {}).items():
        out += _walk(sub, f"{where}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{where}.*")
    if "items" in node:
        out += _walk(node["items"], f"{where}[]")
    return out


def test_schema_is_structural() -> None:
    for where, node in _walk(SCHEMA):
        assert "$ref" not in node and "title" not in node, where
        assert node.get("additionalProperties") is not False, where
        assert not ("properties" in node and "additionalProperties" in node), where
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], where
        else:
            assert "anyOf" not in node and node.get("type") in {"object", "array", "string", "integer", "number",
                                                                 "boolean"}, where
        if "default" in node:  # defaults must themselves be valid
            jsonschema.Draft7Validator(node).validate(node["default"])


# -- examples in, broken manifests out ----------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_admitted_and_parse(path: pathlib.Path) -> None:
    manifest = load(path)
    assert manifest["apiVersion"] == s.API_VERSION and manifest["kind"] == s.KIND
    assert admission_errors(manifest) == []
    s.parse_spec(manifest["spec"])  # the operator and the local runtime read it too


def _broken(edit: dict[str, Any]) -> dict[str, Any]:
    manifest = load(ROOT / "manifests" / "examples" / "smollm2-cpu.yaml")
    manifest["spec"] = _merge(manifest["spec"], edit)
    return manifest


def _merge(base: Any, edit: Any) -> Any:
    if not isinstance(edit, dict) or not isinstance(base, dict):
        return copy.deepcopy(edit)
    out = dict(base)
    for key, value in edit.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(base.get(key), value)
    return out


BROKEN = [  # (id, spec edit, the reason it must be refused for)
    ("min-over-max-replicas", {"scaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas must not exceed"),
    ("ceiling-without-headroom", {"engine": {"ceilings": {"maxTokenBudget": 64, "maxNumSeqs": 256},
                                             "tokenBudget": {"max": 64}, "maxNumSeqs": {"max": 32}}},
     "ceilings.maxTokenBudget must exceed"),
    ("budget-max-over-ceiling", {"engine": {"tokenBudget": {"max": 4096}}}, "tokenBudget.max must not exceed"),
    ("seqs-max-over-ceiling", {"engine": {"maxNumSeqs": {"max": 64}}}, "maxNumSeqs.max must not exceed"),
    ("budget-min-over-max", {"engine": {"tokenBudget": {"min": 900, "max": 800}}}, "tokenBudget.min must not"),
    ("budget-initial-over-max", {"engine": {"tokenBudget": {"initial": 1000, "max": 800}}},
     "tokenBudget.initial must lie within"),
    ("budget-initial-word", {"engine": {"tokenBudget": {"initial": "fast"}}}, s.AUTO_OR_POSITIVE_MESSAGE),
    ("budget-initial-zero", {"engine": {"tokenBudget": {"initial": 0}}}, s.AUTO_OR_POSITIVE_MESSAGE),
    ("budget-beside-seqs", {"engine": {"tokenBudget": {"initial": 40, "min": None}, "maxNumSeqs": {"initial": 32}}},
     "tokenBudget.initial leaves no prefill headroom"),
    ("hf-folder-without-path", {"model": {"source": "hf-folder"}}, "model.path is required"),
    ("unknown-device", {"engine": {"device": "tpu"}}, "'tpu' is not one of"),
    ("odd-block-size", {"engine": {"blockSize": 24}}, "24 is not one of"),
    ("zero-tpot-slo", {"slos": {"tpotP99Ms": 0}}, "less than the minimum"),
    ("negative-replicas", {"replicas": -1}, "less than the minimum"),
    ("kv-fraction-over-one", {"engine": {"kvMemoryFraction": 1.5}}, "greater than the maximum"),
    ("unknown-scaling-mode", {"scaling": {"mode": "auto"}}, "'auto' is not one of"),
    ("node-selector-not-string", {"nodeSelector": {"gpu": 1}}, "1 is not of type 'string'"),
    # Pod fields passed on to the Deployment: refused here, not as a 422 on the child that kopf retried (issue 31).
    ("toleration-exists-with-value", {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "a"}]},
     "operator Exists takes no value"),
    ("toleration-equal-without-key", {"tolerations": [{"value": "a"}]}, "without a key needs operator Exists"),
    ("toleration-seconds-not-noexecute", {"tolerations": [{"key": "gpu", "effect": "NoSchedule",
                                                           "tolerationSeconds": 30}]}, "needs effect NoExecute"),
    ("anti-affinity-required-as-object", {"affinity": {"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"topologyKey": "kubernetes.io/hostname"}}}},
     "is not of type 'array'"),
    ("node-affinity-preferred-as-object", {"affinity": {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": {"weight": 1}}}}, "is not of type 'array'"),
    ("affinity-not-an-object", {"affinity": ["nodeAffinity"]}, "is not of type 'object'"),
    # What only failed at the children: a 422 InvalidChild later, instead of a refusal at `kubectl apply`.
    ("cpu-lots", {"resources": {"requests": {"cpu": "lots"}}}, "does not match"),
    ("negative-memory", {"resources": {"limits": {"memory": "-1Gi"}}}, "does not match"),
    ("negative-integer-quantity", {"resources": {"limits": {"cpu": -2}}}, "less than the minimum"),
    ("gpu-request-without-limit", {"resources": {"requests": {"nvidia.com/gpu": 1}}},
     "a GPU in resources.requests needs the same count in resources.limits"),
    ("gpu-request-over-limit", {"resources": {"requests": {"nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": 1}}},
     "a GPU in resources.requests needs the same count in resources.limits"),
    ("slo-priority-twice", {"slos": {"priority": ["tpot", "tpot", "ttft"]}}, "Duplicate value"),
    ("node-selector-value-not-a-label", {"nodeSelector": {"pool": "gpu nodes"}}, "does not match"),
]


@pytest.mark.parametrize("edit,reason", [(e, r) for _, e, r in BROKEN], ids=[i for i, _, _ in BROKEN])
def test_broken_manifests_are_refused_for_their_reason(edit: dict[str, Any], reason: str) -> None:
    manifest = _broken(edit)
    errors = admission_errors(manifest)
    assert any(reason in error for error in errors), errors
    with pytest.raises(ValidationError):  # the Python twin refuses it too (the local runtime's door)
        s.parse_spec(manifest["spec"])


@pytest.mark.parametrize("name", ["llama.3", "3b-model", "Chat", "a" * (s.NAME_MAX_LENGTH + 1), "chat-"])
def test_a_name_the_services_cannot_take_is_refused(name: str) -> None:
    manifest = load(ROOT / "manifests" / "examples" / "smollm2-cpu.yaml")
    manifest["metadata"]["name"] = name
    assert s.NAME_MESSAGE in admission_errors(manifest)
    assert s.name_problem(name)


@pytest.mark.parametrize("name", ["chat", "llama-3-8b", "a" * s.NAME_MAX_LENGTH])
def test_a_name_the_services_can_take_is_admitted(name: str) -> None:
    manifest = load(ROOT / "manifests" / "examples" / "smollm2-cpu.yaml")
    manifest["metadata"]["name"] = name
    assert admission_errors(manifest) == [] and s.name_problem(name) is None


def test_gpu_requests_equal_to_their_limits_and_quantities_are_admitted() -> None:
    ok = _broken({"resources": {"requests": {"nvidia.com/gpu": 1, "cpu": "500m", "memory": "1.5Gi"},
                                "limits": {"nvidia.com/gpu": "1", "memory": 2147483648}}})
    assert admission_errors(ok) == []
    s.parse_spec(ok["spec"])


def test_a_node_selector_key_that_is_no_label_key_is_refused_by_the_operator() -> None:
    """Refused when the operator (or `stallfree up`) parses the spec, before any child is applied: a CEL rule over a
    map's keys costs more than the API server's estimate admits, so the CRD leaves keys to this check."""
    with pytest.raises(ValidationError, match="nodeSelector keys must be label keys"):
        s.parse_spec(_broken({"nodeSelector": {"gpu type": "h100"}})["spec"])
    s.parse_spec(_broken({"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}})["spec"])


def test_a_manifest_without_spec_is_refused() -> None:
    assert admission_errors({"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": "x"}}) == \
        ["'spec' is a required property"]


def test_defaults_fill_in_as_the_models_do() -> None:
    defaulted = apply_defaults(SCHEMA["properties"]["spec"], {})
    assert defaulted["engine"]["ceilings"] == {"maxTokenBudget": 2048, "maxNumSeqs": 256}
    assert defaulted["engine"]["tokenBudget"]["initial"] == "auto"
    assert s.parse_spec(defaulted) == s.parse_spec({})


# -- the CEL rules and their Python twins agree ----------------------------------------------------------

_INITIAL = st.one_of(st.just("auto"), st.integers(1, 5000))
_ENGINES = st.fixed_dictionaries({
    "ceilings": st.fixed_dictionaries({"maxTokenBudget": st.integers(64, 4096), "maxNumSeqs": st.integers(1, 512)}),
    "tokenBudget": st.fixed_dictionaries({"initial": _INITIAL}, optional={
        "min": st.integers(1, 4096), "max": st.integers(1, 4096)}),
    "maxNumSeqs": st.fixed_dictionaries({"initial": _INITIAL, "min": st.integers(1, 512)},
                                        optional={"max": st.integers(1, 512)}),
})


@settings(max_examples=300, deadline=None)
@given(engine=_ENGINES, min_replicas=st.integers(0, 10), max_replicas=st.integers(1, 10))
def test_cel_rules_and_python_twins_agree(engine: dict[str, Any], min_replicas: int, max_replicas: int) -> None:
    spec = {"engine": engine, "scaling": {"minReplicas": min_replicas, "maxReplicas": max_replicas}}
    manifest = {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": "x"}, "spec": spec}
    errors = admission_errors(manifest)
    try:
        s.parse_spec(copy.deepcopy(spec))
        twin_errors: list[str] = []
    except ValidationError as exc:
        twin_errors = [e["msg"].removeprefix("Value error, ") for e in exc.errors()]
    assert not errors == (not twin_errors)
    # The twin stops at the first broken rule of each object; whatever it names, CEL names too.
    assert set(twin_errors) <= set(errors)
