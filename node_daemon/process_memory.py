"""Hand freed heap memory back to the kernel, so the resident size is what the daemon holds, not what it once held.

Loading a model frees hundreds of MB of temporaries (codes decoded, tiles built, copies made). glibc keeps freed
chunks in its arenas for reuse and returns only the top of each heap, so that memory stays resident for the
daemon's life unless it is asked back: malloc_trim(0) releases every free page of every arena. Other C
libraries (musl) return memory on their own; there it is a no-op.

Serving allocates and frees large buffers every iteration from several threads: a prefill chunk's activations
(8 MB for the 1B's gate/up at 256 tokens), a 262k vocabulary's logits (1 MB a row, 16 MB at 16 rows). With
glibc's defaults each thread may get an arena of its own (8 per core). bound_heap_growth() keeps two arenas and
serves blocks up to 32 MB from them (MALLOC_* variables in the environment win): a block mapped on its own is
unmapped when freed, and its next use faults in and zeroes every page again. Mapped above 256 KB, as it was,
that cost a 1,500-token prompt's TTFT on the 1B 6.38 -> 5.71-5.91 s and Gemma 3 270M's decode 7% (one stream) to
15-20% (16 streams). The arenas then hold what an iteration frees for the next one; the engine hands it back
once serving goes quiet (release_freed_heap after each burst), so an idle daemon is back to what it holds.
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
    "MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, 32 << 20),  # glibc's largest: an iteration's buffers reused
    "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, 64 << 20),  # past a burst's free top; the rest when quiet
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


def release_freed_heap() -> int:
    """malloc_trim(0): the resident bytes it gave back (0 without glibc or /proc)."""
    libc = _glibc()
    if libc is None:
        return 0
    before = resident_bytes()
    libc.malloc_trim(0)
    now = resident_bytes()
    return max(0, (before or 0) - (now or 0))


def return_freed_memory(after: str) -> int:
    """release_freed_heap() at a start-up step; logs and returns the resident bytes it gave back."""
    released = release_freed_heap()
    if released >= 1 << 20:
        log.info("start-up: %d MB of freed heap returned to the system after %s", released >> 20, after)
    return released
