"""The InferenceService spec models: defaults, the cross-field rules' Python twins, clear errors, and
the checks a schema cannot express (checks.problems)."""
from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from stallfree.contracts import min_budget_for
from stallfree.operator.api import checks
from stallfree.operator.api import spec as s


def error_of(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        s.parse_spec(data)
    return s.spec_errors(info.value)


def test_defaults_describe_a_servable_cpu_default() -> None:
    spec = s.parse_spec({})
    assert spec.model.source == "embedded" and spec.model.daemon_model == "smollm2-135m"
    assert spec.engine.ceilings.max_token_budget >= min_budget_for(spec.engine.ceilings.max_num_seqs)
    assert spec.engine.token_budget.initial == s.AUTO
    assert (spec.scaling.mode, spec.tuning.mode, spec.replicas) == ("managed", "auto", 1)
    assert checks.problems(spec) == []


def test_manifest_round_trip_uses_camel_case() -> None:
    data = {"model": {"source": "random", "name": "tiny", "maxModelLen": 512},
            "engine": {"tokenBudget": {"initial": 256, "max": 1024}, "maxNumSeqs": {"initial": 8}},
            "slos": {"tpotP99Ms": 80}, "scaling": {"minReplicas": 2, "maxReplicas": 3}, "replicas": 2}
    spec = s.parse_spec(data)
    assert spec.engine.token_budget.initial == 256 and spec.slos.tpot_p99_ms == 80
    manifest = spec.to_manifest()
    assert manifest["engine"]["tokenBudget"] == {"initial": 256, "max": 1024}
    assert s.parse_spec(manifest) == spec


@pytest.mark.parametrize("data,message", [
    ({"scaling": {"minReplicas": 3, "maxReplicas": 2}}, "spec.scaling: scaling.minReplicas must not exceed"),
    ({"engine": {"ceilings": {"maxTokenBudget": 100, "maxNumSeqs": 80}}}, "ceilings.maxTokenBudget must exceed"),
    ({"engine": {"tokenBudget": {"max": 4096}}}, "tokenBudget.max must not exceed ceilings"),
    ({"engine": {"maxNumSeqs": {"min": 300}}}, "maxNumSeqs.min must not exceed"),
    ({"engine": {"tokenBudget": {"max": 40}, "maxNumSeqs": {"min": 16}}}, "tokenBudget.max leaves no prefill headroom"),
    ({"engine": {"tokenBudget": {"initial": 64}, "maxNumSeqs": {"initial": 64}}},
     "tokenBudget.initial leaves no prefill headroom beside maxNumSeqs.initial"),
    ({"engine": {"tokenBudget": {"initial": 40}, "maxNumSeqs": {"min": 16}}},
     "tokenBudget.initial leaves no prefill headroom beside maxNumSeqs.min"),
    ({"engine": {"tokenBudget": {"initial": "fast"}}}, 'spec.engine.tokenBudget.initial: must be a positive integer or "auto"'),
    ({"model": {"source": "gguf"}}, "model.path is required"),
    ({"engine": {"devcie": "cpu"}}, "spec.engine.devcie: Extra inputs are not permitted"),
    ({"slos": {"tpotP99Ms": 0}}, "spec.slos.tpotP99Ms: Input should be greater than or equal to 1"),
])
def test_bad_specs_are_refused_with_the_field_named(data: dict[str, Any], message: str) -> None:
    assert message in error_of(data)


def test_every_problem_is_reported_at_once() -> None:
    message = error_of({"scaling": {"minReplicas": 3, "maxReplicas": 2}, "engine": {"device": "tpu"}})
    assert "scaling.minReplicas" in message and "spec.engine.device" in message


@pytest.mark.parametrize("replicas,expected", [(0, 1), (1, 1), (3, 3), (9, 4)])
def test_desired_replicas_stay_inside_the_scaling_bounds(replicas: int, expected: int) -> None:
    spec = s.parse_spec({"replicas": replicas, "scaling": {"minReplicas": 1, "maxReplicas": 4}})
    assert spec.desired_replicas() == expected


# -- what a schema cannot know ---------------------------------------------------------------------------

@pytest.mark.parametrize("data,problem", [
    ({"model": {"name": "llama-9000"}}, "is not an embedded model"),
    ({"model": {"source": "random", "name": "gpt-5"}}, "is not a known shape"),
    ({"model": {"source": "hf-folder", "path": "models/llama"}}, "must be an absolute path"),
    ({"model": {"source": "gguf", "path": "/models/llama.bin"}}, "must name a .gguf file"),
    ({"model": {"source": "hf-folder", "path": "/data/llama", "volume": {"persistentVolumeClaim": {"claimName": "m"}}}},
     "is not under model.mountPath"),
    ({"model": {"maxModelLen": 100000}}, "exceeds smollm2-135m's context"),
    ({"engine": {"device": "cuda"}}, "asks for no GPU"),
    ({"engine": {"device": "cpu", "attentionBackend": "flashinfer"}}, "needs a GPU"),
])
def test_undeployable_specs_are_named(data: dict[str, Any], problem: str) -> None:
    problems = checks.problems(s.parse_spec(data))
    assert len(problems) == 1 and problem in problems[0], problems


def test_gpu_specs_with_a_gpu_are_deployable() -> None:
    spec = s.parse_spec({"model": {"source": "hf-folder", "path": "/models/llama",
                                   "volume": {"persistentVolumeClaim": {"claimName": "m"}}},
                         "engine": {"device": "cuda", "attentionBackend": "triton"},
                         "resources": {"limits": {"nvidia.com/gpu": 1}}})
    assert checks.problems(spec) == []
    assert checks.gpu_count(spec) == 1
    # The sim backend needs no GPU whatever device it names.
    assert checks.problems(s.parse_spec({"engine": {"backend": "sim", "device": "cuda"}})) == []
