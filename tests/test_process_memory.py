"""The daemon's glibc settings: a large block freed while serving leaves the process's resident size, and an
operator's MALLOC_* variable wins over the daemon's choice. Each case runs in a fresh interpreter (malloc's state
is per process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stallfree.node_daemon import process_memory

pytestmark = pytest.mark.skipif(process_memory._glibc() is None or not os.path.exists("/proc/self/statm"),
                                reason="glibc and /proc only")

# Frees a 4 MB block twice over (the second time is the one glibc's dynamic threshold keeps in its heap) and
# prints the resident growth the second block left behind once freed.
PROBE = """
import ctypes, json, sys
from stallfree.node_daemon import process_memory
applied = process_memory.bound_heap_growth() if sys.argv[1] == "bound" else {}
libc = process_memory._glibc()
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 4 << 20
for _ in range(2):
    before = process_memory.resident_bytes()
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    kept = process_memory.resident_bytes() - before
print(json.dumps({"applied": applied, "kept": kept}))
"""


def probe(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=environment,
                          timeout=60, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_large_block_freed_while_serving_leaves_the_resident_size():
    default, bound = probe("default"), probe("bound")
    assert default["kept"] >= 3 << 20, "glibc's dynamic threshold should keep the second block (the case fixed)"
    assert bound["kept"] < 1 << 20
    assert set(bound["applied"]) == set(process_memory.SERVING_MALLOC)


def test_an_operators_malloc_variable_wins():
    applied = probe("bound", MALLOC_MMAP_THRESHOLD_="33554432")["applied"]
    assert "MALLOC_MMAP_THRESHOLD_" not in applied
    assert set(applied) == {"MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_"}
