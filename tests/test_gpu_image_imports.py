"""The GPU run's imports against what the GPU machine will hold (e2e/gpu/gpu_image.py: its image's packages and
what the run carries): every module the run needs imports, and the dry run passes, with anything else refused.
A new dependency fails here, before a GPU call would find it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

GPU_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e", "gpu")


def run_refusing(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    prelude = f"import sys; sys.path.insert(0, {GPU_DIR!r}); import gpu_image; gpu_image.refuse_outside_image()\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_every_module_the_run_needs_imports_from_the_image_and_the_carried_wheels():
    done = run_refusing("import importlib\nfor m in gpu_image.RUN_MODULES: importlib.import_module(m)\nprint('ok')")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_module_outside_the_image_is_refused():
    done = run_refusing("import kopf")
    assert done.returncode != 0 and "on the GPU image" in done.stderr


def test_the_dry_run_passes_with_only_the_image_and_carried_packages(tmp_path):
    out = tmp_path / "dry.json"
    code = (f"import runpy; sys.argv = ['gpu_check.py', '--dry-run', '--sections', 'correctness,engine,fused_ops', "
            f"'--json', {str(out)!r}]\n"
            f"try:\n    runpy.run_path({os.path.join(GPU_DIR, 'gpu_check.py')!r}, run_name='__main__')\n"
            f"except SystemExit as e:\n    sys.exit(e.code)")
    done = run_refusing(code)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(out.read_text())["problems"] == []
