"""The images build: the wheel stage of e2e/cluster/Dockerfile, rebuilt here from exactly its COPY lines.

No Docker engine runs in the suite, so the build context is reproduced (tests/dockerfile_context.py)
and `pip wheel` runs on it as the stage's RUN does. What a real `docker build` adds (the base image,
apt, PyPI's torch) is not proven here.
"""
from __future__ import annotations

import email
import pathlib
import subprocess
import sys
import tomllib
import zipfile

import pytest
import yaml

from dockerfile_context import ROOT, context_copies, rebuild_context, stages
from stallfree.cli import DAEMON_EXTRA
from stallfree.operator.reconcile import images

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def copied_paths(stage: str) -> set[str]:
    return {source.rstrip("/") for sources, _ in context_copies(stages()[stage]) for source in sources}


def test_the_wheel_stage_copies_every_folder_pyproject_packages() -> None:
    needed = set(SETUPTOOLS["package-dir"].values()) | {"pyproject.toml", PYPROJECT["project"]["readme"]}
    assert needed <= copied_paths("wheel"), sorted(needed - copied_paths("wheel"))


def test_every_target_the_docs_name_exists() -> None:
    assert {"wheel", "control-plane", "serving-cpu", "serving-cuda"} <= set(stages())


def _module_files(package: str) -> set[str]:
    """Every module and package-data file setuptools must put in the wheel for one listed package."""
    parts = package.split(".")
    for depth in range(len(parts), 0, -1):
        mapped = SETUPTOOLS["package-dir"].get(".".join(parts[:depth]))
        if mapped is not None:
            folder = ROOT / mapped / pathlib.Path(*parts[depth:])
            break
    prefix = "/".join(parts)
    files = {f"{prefix}/{p.name}" for p in folder.glob("*.py")}
    for pattern in SETUPTOOLS.get("package-data", {}).get(package, []):
        files |= {f"{prefix}/{p.relative_to(folder).as_posix()}" for p in folder.glob(pattern)}
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    context = tmp_path_factory.mktemp("context")
    rebuild_context(stages()["wheel"], context)
    out = tmp_path_factory.mktemp("wheels")
    # As the stage's `pip wheel --no-deps .`; without build isolation (no download: setuptools is here).
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "--wheel-dir", str(out), str(context)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = out.glob("stallfree-*.whl")
    return built


def test_the_wheel_built_from_that_context_holds_every_module(wheel: pathlib.Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set().union(*(_module_files(p) for p in SETUPTOOLS["packages"]))
    assert expected and not expected - names, sorted(expected - names)


def test_the_control_plane_installs_no_daemon_extra(wheel: pathlib.Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_string(z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode())
    base = {req.split(";")[0].strip().split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
            for req in meta.get_all("Requires-Dist") if "extra ==" not in req}
    assert base and not base & DAEMON_EXTRA, base & DAEMON_EXTRA
    runs = " ".join(rest for word, rest in stages()["control-plane"] if word == "RUN")
    assert "stallfree-*.whl" in runs and "[" not in runs  # the bare wheel: no extra at all
    serving = " ".join(rest for word, rest in stages()["serving-cpu"] if word == "RUN")
    assert "[daemon]" in serving


def test_the_manifests_name_the_images_the_build_script_tags() -> None:
    script = (ROOT / "e2e" / "cluster" / "build-images.sh").read_text()
    assert f"REGISTRY=${{REGISTRY:-{images.REGISTRY}}}" in script and f"TAG=${{TAG:-{images.TAG}}}" in script
    assert '"$REGISTRY/stallfree-control-plane:$TAG"' in script and '"$REGISTRY/stallfree:$TAG"' in script
    operator = ROOT / "manifests" / "operator"
    container = yaml.safe_load((operator / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == images.CONTROL_PLANE_IMAGE
    assert env[images.SERVING_IMAGE_ENV] == images.SERVING_IMAGE
    assert env[images.CONTROL_PLANE_IMAGE_ENV] == images.CONTROL_PLANE_IMAGE
    kustomization = yaml.safe_load((operator / "kustomization.yaml").read_text())
    assert {i["name"] for i in kustomization["images"]} == {
        image.rpartition(":")[0] for image in (images.SERVING_IMAGE, images.CONTROL_PLANE_IMAGE)}
