"""Hand freed heap memory back to the kernel, so the resident size is what the daemon holds, not what it once held.

Loading a model frees hundreds of MB of temporaries (codes decoded, tiles built, copies made). glibc keeps freed
chunks in its arenas for reuse and returns only the top of each heap, so that memory stays resident for the
daemon's life unless it is asked back: malloc_trim(0) releases every free page of every arena. Other C
libraries (musl) return memory on their own; there it is a no-op.
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
