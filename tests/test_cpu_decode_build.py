"""The compiled forward's background build (models/cpu_decode.py): it compiles in a child process of its own
session, and a daemon that stops while it compiles takes the compiler with it. A process starts a build into an
empty cache, exits once the compiler runs, and no process of the build's session is left; and what the killed
build left behind (cpp_extension's lock file among it) does not stop the next build, which compiles and loads."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

STARTS_A_BUILD_AND_EXITS = """
import sys, time
from stallfree.node_daemon.models import cpu_decode
from test_cpu_decode_build import _session
assert cpu_decode.ensure_built(background=True) is False
for _ in range(200):  # until the child runs (and has started compiling)
    child = cpu_decode._state["child"]
    if child is not None:
        break
    time.sleep(0.05)
assert child is not None and cpu_decode.is_building()
print(child.pid, flush=True)
for _ in range(300):  # until the compiler runs (the child imports torch first)
    if any(name in ("(cc1plus)", "(ninja)") for name in _session(child.pid)):
        break
    time.sleep(0.05)
else:
    raise AssertionError("no compiler started")
sys.exit(0)  # a stopping daemon: atexit kills the build's session
"""


BUILDS_HERE = """
from stallfree.node_daemon.models import cpu_decode
assert cpu_decode.ensure_built(background=False), cpu_decode.why_not()
"""


def _session(sid: int) -> list[str]:
    """The commands of the live processes of session `sid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(stat.split(" ", 2)[1])
    return members


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_daemon_that_stops_while_compiling_leaves_no_compiler_running(tmp_path):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    env = {**os.environ, "STALLFREE_EXT_CACHE": str(tmp_path),  # empty: the build has to compile
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", STARTS_A_BUILD_AND_EXITS], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    sid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 5.0
    while _session(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session(sid) == []
    assert not list(tmp_path.rglob("*.so"))  # stopped before it finished
    assert list(tmp_path.rglob("lock"))  # cpp_extension's lock, left by the killed build
    again = subprocess.run([sys.executable, "-c", BUILDS_HERE], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert list(tmp_path.rglob("*.so"))
