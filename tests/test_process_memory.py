"""The daemon's glibc settings: a large block freed while serving is reused from the heap by the next iteration
(no page faulted in and zeroed again), and handed back to the kernel once released (as the engine does after each
burst); an operator's MALLOC_* variable wins over the daemon's choice. Each case runs in a fresh interpreter
(malloc's state is per process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stallfree.node_daemon import process_memory

pytestmark = pytest.mark.skipif(process_memory._glibc() is None or not os.path.exists("/proc/self/statm"),
                                reason="glibc and /proc only")

# Takes, writes and frees an 8 MB block three times (the size of a 256-token chunk's gate/up activations on a 1B
# model), then releases the freed heap as the engine does when quiet. Prints the page faults of the last round and
# the resident growth left after the release.
PROBE = """
import ctypes, json, resource, sys
from stallfree.node_daemon import process_memory
applied = process_memory.bound_heap_growth() if sys.argv[1] == "bound" else {}
libc = process_memory._glibc()
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 8 << 20
before = process_memory.resident_bytes()
for _ in range(3):
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
held = process_memory.resident_bytes() - before
process_memory.release_freed_heap()
kept = process_memory.resident_bytes() - before
print(json.dumps({"applied": applied, "faults": faults, "held": held, "kept": kept}))
"""


def probe(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=environment,
                          timeout=60, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_block_an_iteration_frees_is_reused_then_handed_back_when_released():
    bound = probe("bound")
    assert set(bound["applied"]) == set(process_memory.SERVING_MALLOC)
    assert bound["faults"] < 64, "the freed block should come back from the heap, not be mapped and zeroed again"
    assert bound["held"] >= 6 << 20, "between iterations the heap keeps the block"
    assert bound["kept"] < 1 << 20, "released, its pages leave the resident size"
    mapped = probe("bound", MALLOC_MMAP_THRESHOLD_=str(256 << 10))
    assert mapped["faults"] >= (8 << 20) // 4096 // 2, "a block mapped on its own is faulted in again every time"


def test_an_operators_malloc_variable_wins():
    applied = probe("bound", MALLOC_MMAP_THRESHOLD_="262144")["applied"]
    assert "MALLOC_MMAP_THRESHOLD_" not in applied
    assert set(applied) == {"MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_"}
