"""Hand freed heap memory back to the kernel, so the resident size is what the daemon holds, not what it once held.

Loading a model frees hundreds of MB of temporaries (codes decoded, tiles built, copies made). glibc keeps freed
chunks in its arenas for reuse and returns only the top of each heap, so that memory stays resident for the
daemon's life unless it is asked back: malloc_trim(0) releases every free page of every arena. Other C
libraries (musl) return memory on their own; there it is a no-op.

Serving allocates and frees large buffers every iteration (logits of a 262k vocabulary are 1 MB a row) from
several threads. With glibc's defaults each thread may get an arena of its own (8 per core), and after the first
large free the mmap threshold climbs to that size, so later large buffers come from the arenas and stay resident
once freed. bound_heap_growth() fixes both (MALLOC_* variables in the environment win): Gemma 3 270M's peak
resident size in `stallfree bench engine` fell from 1,372-1,394 MB to 1,309-1,312 MB, its speed unchanged.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = libc if hasattr(libc, "malloc_trim") else False  # type: ignore[assignment]
        except OSError:
            _libc = False  # type: ignore[assignment]
    return _libc or None


# glibc's mallopt parameters (malloc.h), each with the environment variable that sets it at process start.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
SERVING_MALLOC = {
    "MALLOC_ARENA_MAX": (M_ARENA_MAX, 2),  # the engine thread, the server's threads: two heaps, not one per thread
    "MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, 256 << 10),  # larger blocks mapped, unmapped when freed
    "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, 1 << 20),  # a heap's free top past 1 MB handed back
}


def bound_heap_growth() -> dict[str, int]:
    """Set SERVING_MALLOC through mallopt, except where its environment variable is set (the operator's choice
    stands); returns what it set. Call it before the serving threads start: arenas made earlier stay."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return {}
    applied = {}
    for variable, (parameter, value) in SERVING_MALLOC.items():
        if variable not in os.environ and libc.mallopt(parameter, value) == 1:
            applied[variable] = value
    return applied


def resident_bytes() -> int | None:
    """This process's resident set size from /proc (None where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def return_freed_memory(after: str) -> int:
    """malloc_trim(0); logs and returns the resident bytes it gave back (0 without glibc or /proc)."""
    libc = _glibc()
    if libc is None:
        return 0
    before = resident_bytes()
    libc.malloc_trim(0)
    now = resident_bytes()
    released = max(0, (before or 0) - (now or 0))
    if released >= 1 << 20:
        log.info("start-up: %d MB of freed heap returned to the system after %s", released >> 20, after)
    return released
