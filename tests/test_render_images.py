"""The images the operator renders: daemons run the serving image, routers the control-plane image, and
both follow what the operator's Deployment names (the values kustomize's `images:` rewrites)."""
from __future__ import annotations

import pytest

from stallfree.operator.api import spec as s
from stallfree.operator.reconcile import images, render


def rendered(spec: dict) -> dict[str, dict]:
    parsed = s.parse_spec(spec)
    children = render.children("chat", "ns", parsed, render.StartupKnobs.from_spec(parsed), with_service_monitor=False)
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "Deployment"}


def image(deployment: dict) -> str:
    return deployment["spec"]["template"]["spec"]["containers"][0]["image"]


def test_defaults_are_the_tags_the_dockerfile_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(images.SERVING_IMAGE_ENV, raising=False)
    monkeypatch.delenv(images.CONTROL_PLANE_IMAGE_ENV, raising=False)
    out = rendered({})
    assert image(out["chat"]) == images.SERVING_IMAGE
    assert image(out["chat-router"]) == images.CONTROL_PLANE_IMAGE  # no torch in front of every replica


def test_the_operators_environment_moves_daemons_and_routers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(images.SERVING_IMAGE_ENV, "reg.example/stallfree:dev")
    monkeypatch.setenv(images.CONTROL_PLANE_IMAGE_ENV, "reg.example/stallfree-control-plane:dev")
    before = render.template_hash(s.parse_spec({}))
    out = rendered({})
    assert image(out["chat"]) == "reg.example/stallfree:dev"
    assert image(out["chat-router"]) == "reg.example/stallfree-control-plane:dev"
    monkeypatch.setenv(images.SERVING_IMAGE_ENV, "reg.example/stallfree:dev2")
    assert render.template_hash(s.parse_spec({})) != before  # an upgraded default rolls the daemons


def test_a_spec_that_names_its_image_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(images.SERVING_IMAGE_ENV, "reg.example/stallfree:dev")
    out = rendered({"engine": {"image": "mine/stallfree:patched"}})
    assert image(out["chat"]) == "mine/stallfree:patched"
    assert image(out["chat-router"]) == images.control_plane_image()
