"""The design's nevers, as import-linter contracts (pyproject.toml), and what each install profile loads."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent))


def _lint(config: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--config", str(config), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (the test extra)")
def test_every_layering_contract_is_kept():
    result = _lint(ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (the test extra)")
def test_a_forbidden_import_breaks_the_lint(tmp_path):
    # The same roots, with one contract that the real code breaks (the engine loop imports the scheduler):
    # proves the linter sees the project's real import graph, not an empty one.
    config = (ROOT / "pyproject.toml").read_text()
    config += '''
[[tool.importlinter.contracts]]
name = "deliberately broken: the engine loop may not import the scheduler"
type = "forbidden"
source_modules = ["stallfree.node_daemon.engine.engine"]
forbidden_modules = ["stallfree.node_daemon.engine.scheduler"]
'''
    path = tmp_path / "pyproject.toml"
    path.write_text(config)
    result = _lint(path)
    assert result.returncode != 0
    text = " ".join(result.stdout.split())  # the report wraps long lines
    assert "deliberately broken: the engine loop may not import the scheduler BROKEN" in text
    assert "stallfree.node_daemon.engine.engine -> stallfree.node_daemon.engine.scheduler" in text


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (the test extra)")
def test_the_layers_and_commons_contracts_see_the_real_graph(tmp_path):
    # Contracts the real code breaks: the daemon above the kernels it imports (a layers contract turned over),
    # common/ importing nothing at all (contracts.py imports bisect) and the loop without its tuner: proves the
    # layer names, the root "stallfree" (common/'s modules) and the control package's modules are analysed.
    config = (ROOT / "pyproject.toml").read_text()
    config += '''
[[tool.importlinter.contracts]]
name = "deliberately broken: kernels above the daemon"
type = "layers"
layers = ["stallfree.kernels", "stallfree.node_daemon"]

[[tool.importlinter.contracts]]
name = "deliberately broken: contracts import nothing"
type = "forbidden"
source_modules = ["stallfree.contracts"]
forbidden_modules = ["bisect"]

[[tool.importlinter.contracts]]
name = "deliberately broken: the control loop may not import the tuner"
type = "forbidden"
source_modules = ["stallfree.operator.control.loop"]
forbidden_modules = ["stallfree.operator.control.tuner"]
'''
    path = tmp_path / "pyproject.toml"
    path.write_text(config)
    result = _lint(path)
    text = " ".join(result.stdout.split())
    assert "deliberately broken: kernels above the daemon BROKEN" in text
    assert "deliberately broken: contracts import nothing BROKEN" in text
    assert "stallfree.contracts -> bisect" in text
    # The control package's insides are named as the graph has them (its purity contracts are not vacuous).
    assert "deliberately broken: the control loop may not import the tuner BROKEN" in text
    real = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {real} kept, 3 broken." in text  # every real contract still holds


def _modules_loaded_by(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout))


def _loaded(modules: set[str], prefix: str) -> list[str]:
    return sorted(m for m in modules if m == prefix or m.startswith(prefix + "."))


def test_the_control_laws_load_no_io_library():
    loaded = _modules_loaded_by("import stallfree.operator.control.tuner, stallfree.operator.control.scaler")
    for io in ("kopf", "kubernetes", "httpx", "fastapi", "torch"):
        assert not _loaded(loaded, io), f"the tuner/scaler load {io}"


def test_the_reconciler_loads_no_daemon_module():
    loaded = _modules_loaded_by("import stallfree.operator.reconcile.handlers, stallfree.operator.reconcile.control_handlers")
    assert not _loaded(loaded, "stallfree.node_daemon")
    assert not _loaded(loaded, "torch")


def test_the_router_loads_no_daemon_module_and_no_torch():
    modules = sorted(f"stallfree.operator.router.{f.stem}" for f in (ROOT / "operator" / "router").glob("*.py")
                     if f.stem != "__init__")
    loaded = _modules_loaded_by("import " + ", ".join(modules))
    assert "stallfree.operator.router.proxy" in loaded
    for heavy in ("stallfree.node_daemon", "stallfree.kernels", "torch", "numpy", "triton"):
        assert not _loaded(loaded, heavy), f"the router loads {heavy}"


BLOCK_DAEMON_EXTRA = """
import sys, importlib.abc
from stallfree.cli import DAEMON_EXTRA
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in DAEMON_EXTRA:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from stallfree.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv, expected", [(["crd"], "CustomResourceDefinition"),
                                            (["operator", "--help"], "usage: stallfree operator"),
                                            (["router", "--help"], "usage: stallfree router")])
def test_the_control_plane_runs_without_the_daemon_extra(argv, expected):
    # As after `pip install stallfree` (no [daemon]): torch, numpy, tokenizers... cannot be imported.
    result = subprocess.run([sys.executable, "-c", BLOCK_DAEMON_EXTRA, *argv], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


def test_a_daemon_command_without_the_extra_says_what_to_install():
    result = subprocess.run([sys.executable, "-c", BLOCK_DAEMON_EXTRA, "serve", "--model", "smollm2-135m"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "pip install 'stallfree[daemon]'" in result.stderr
