"""A new GGUF file's tokenizer built in a child process while the daemon starts.

Building the tokenizer a GGUF file describes is Python throughout (every split of every piece tried as a merge:
Gemma 3's 262k pieces, 2.5 s) and holds the GIL for all of it, so on a thread it slows by as much the imports
and the weights' load beside it. A child process builds it on the other core and writes it to the tokenizer
cache (text/tokenizer_cache.py); the daemon's tokenizer thread waits for the child, then reads the file back.
Only where the cache is on and holds no file for this GGUF file yet. A child that fails, or takes longer than
CHILD_TIMEOUT_S, leaves the build to the daemon, as before: the cache is an optimisation, never a failed start.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
from typing import Callable

log = logging.getLogger(__name__)

CHILD_TIMEOUT_S = 120.0

_children: dict[str, Callable[[], None]] = {}  # GGUF path -> wait for its child


def start(path: str) -> None:
    """Start the child that builds this file's tokenizer into the cache, unless the cache is off or has it."""
    from stallfree.node_daemon.text.tokenizer_cache import cache_file

    key = os.path.abspath(path)
    target = cache_file(path)
    if key in _children or target is None or target.exists():
        return
    try:
        child = subprocess.Popen([sys.executable, "-m", __name__, key], stdin=subprocess.DEVNULL)
    except OSError as exc:
        log.info("tokenizer: no child process to build it (%s): built in this process", exc)
        return
    atexit.register(_stop, child)

    def wait() -> None:
        try:
            code = child.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
            _stop(child)
        if code != 0:
            log.warning("tokenizer: the child process building it %s: built in this process",
                        "timed out" if code is None else f"exited with {code}")

    _children[key] = wait


def waiter(path: str) -> Callable[[], None] | None:
    """What to call before reading this file's tokenizer from the cache (its child's end); None: no child."""
    return _children.pop(os.path.abspath(path), None)


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()
        child.wait()


def _build(path: str) -> int:
    """The child: read the file's header, build its tokenizer (which writes the cache), exit."""
    try:  # Linux: gone when the daemon is, however it ends
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    from stallfree.node_daemon.models.gguf_file import GGUFFile
    from stallfree.node_daemon.text.tokenizer import from_gguf_metadata

    fields = GGUFFile(path).fields
    from_gguf_metadata({k: v for k, v in fields.items() if k.startswith("tokenizer.")}, path)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(_build(sys.argv[1]))
