"""spec.objectives (issue 33): parsing, defaults from spec.slos, refused specs, the CRD, and the router's flag."""
from __future__ import annotations

import json
import pathlib

import pytest
import yaml
from pydantic import ValidationError

from stallfree.operator.api import crd
from stallfree.operator.api import spec as s
from stallfree.operator.reconcile import render
from stallfree.operator.router.objectives import parse_objectives

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "manifests" / "examples" / "llama-3-8b-sim-objectives.yaml"
TWO = {"slos": {"ttftP99Ms": 1500, "tpotP99Ms": 80, "queueWaitP99Ms": 700},
       "objectives": [{"name": "interactive", "priority": 10, "ttftP99Ms": 500},
                      {"name": "batch", "priority": -1, "ttftP99Ms": 30000, "tpotP99Ms": 400}],
       "defaultObjective": "interactive"}


def _error(data: dict) -> str:
    with pytest.raises(ValidationError) as info:
        s.parse_spec(data)
    return s.spec_errors(info.value)


def test_without_objectives_one_implicit_objective_has_the_slos_at_priority_0():
    spec = s.parse_spec({"slos": {"ttftP99Ms": 900}})
    assert spec.objectives == []
    (only,) = spec.resolved_objectives()
    assert (only.name, only.priority, only.ttft_p99_ms) == ("default", 0, 900)
    assert only.default and not only.sheddable
    # The router is handed nothing new: its queue stays first come, first served.
    assert "--objectives" not in render.router_args("x", spec)


def test_objectives_take_their_missing_targets_from_the_slos_and_one_is_default():
    spec = s.parse_spec(TWO)
    interactive, batch = spec.resolved_objectives()
    assert (interactive.ttft_p99_ms, interactive.tpot_p99_ms, interactive.queue_wait_p99_ms) == (500, 80, 700)
    assert (batch.ttft_p99_ms, batch.tpot_p99_ms, batch.queue_wait_p99_ms) == (30000, 400, 700)
    assert interactive.default and not batch.default
    assert batch.sheddable and not interactive.sheddable
    # Without defaultObjective the first listed is the default.
    first, second = s.parse_spec({**TWO, "defaultObjective": None}).resolved_objectives()
    assert first.default and not second.default


def test_the_router_gets_the_resolved_objectives_and_reads_them_back():
    spec = s.parse_spec({**TWO, "defaultObjective": "batch"})
    args = render.router_args("x", spec)
    text = args[args.index("--objectives") + 1]
    parsed = parse_objectives(text)
    assert parsed.default.name == "batch"
    assert parsed.by_name["interactive"].priority == 10 and parsed.by_name["interactive"].ttft_ms == 500
    assert parsed.by_name["batch"].tpot_ms == 400 and parsed.by_name["batch"].queue_wait_ms == 700


def test_editing_objectives_does_not_roll_the_daemons():
    assert render.template_hash(s.parse_spec({})) == render.template_hash(s.parse_spec(TWO))


@pytest.mark.parametrize("data, message", [
    ({"objectives": [{"name": "a"}, {"name": "a", "priority": 3}]}, "objectives: each name may appear once"),
    ({"objectives": [{"name": "a"}], "defaultObjective": "b"}, "defaultObjective must name one of spec.objectives"),
    ({"defaultObjective": "a"}, "defaultObjective must name one of spec.objectives"),
    ({"objectives": [{"name": "Has Space"}]}, "spec.objectives.0.name: String should match pattern"),
    ({"objectives": [{"name": "a", "priority": 5000}]}, "spec.objectives.0.priority: Input should be less than"),
    ({"objectives": [{"name": "a", "ttftP99Ms": 0}]}, "spec.objectives.0.ttftP99Ms: Input should be greater"),
    ({"objectives": [{"name": "a", "deadline": 3}]}, "spec.objectives.0.deadline: Extra inputs are not permitted"),
    ({"objectives": [{"name": f"o{i}"} for i in range(17)]}, "spec.objectives: List should have at most 16 items"),
])
def test_invalid_objectives_are_refused_with_the_field_named(data: dict, message: str):
    assert message in _error(data)


def test_the_crd_carries_objectives_with_unique_names_and_the_default_rule():
    schema = crd.spec_schema()
    objectives = schema["properties"]["objectives"]
    assert objectives["maxItems"] == s.MAX_OBJECTIVES
    assert objectives["x-kubernetes-list-type"] == "map" and objectives["x-kubernetes-list-map-keys"] == ["name"]
    assert objectives["items"]["required"] == ["name"]
    assert set(objectives["items"]["properties"]) == {"name", "priority", "ttftP99Ms", "tpotP99Ms", "queueWaitP99Ms"}
    rules = [r["rule"] for r in schema.get("x-kubernetes-validations", [])]
    assert any("self.defaultObjective" in r for r in rules)
    assert all(r != "true" for r in rules)  # the list-map check is the API server's own, no CEL for it
    # The example manifest with objectives is admitted by the models.
    spec = s.parse_spec(yaml.safe_load(EXAMPLE.read_text())["spec"])
    assert [o.name for o in spec.resolved_objectives() if o.default] == ["interactive"]


@pytest.mark.parametrize("text, message", [
    ("not json", "--objectives is not JSON"),
    ("[]", "non-empty JSON list"),
    (json.dumps([{"name": "a"}, {"name": "a"}]), "names an objective twice"),
    (json.dumps([{"name": "a", "default": True}, {"name": "b", "default": True}]), "more than one objective default"),
    (json.dumps([{"name": "a", "priority": "high"}]), "priority must be an integer"),
    (json.dumps([{"name": "a", "ttftP99Ms": -1}]), "ttftP99Ms must be a positive number"),
])
def test_the_routers_flag_refuses_bad_objectives(text: str, message: str):
    with pytest.raises(ValueError, match=message):
        parse_objectives(text)


def test_stallfree_router_refuses_bad_objectives_at_start(capsys):
    from stallfree.cli.router import main

    assert main(["--replicas", "http://127.0.0.1:1", "--objectives", "[{\"name\": \"a\", \"priority\": 1.5}]"]) == 2
    assert "priority must be an integer" in capsys.readouterr().err
