"""A `stallfree serve` child process for the benchmarks that start their own daemon (itl, kv-estimate, hostile).

Its output goes to a log file, never to a pipe: a pipe read only at exit fills at 64 KiB of warnings and the
daemon blocks on its next write. The log's tail is the error when the daemon exits before it is ready.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

from stallfree.ready import ExitedBeforeReady, NotReadyInTime, answers_ready, wait_until_ready

__all__ = ["log_tail", "start", "stop", "wait_ready"]

TAIL_BYTES = 2000


def start(cmd: list[str], env: dict[str, str] | None = None, log_path: Path | None = None
          ) -> tuple[subprocess.Popen, Path]:
    """Start `cmd` with stdout and stderr appended to `log_path` (a fresh temporary file when None)."""
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="stallfree-bench-daemon-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    return process, log_path


def log_tail(log_path: Path, max_bytes: int = TAIL_BYTES) -> str:
    try:
        with open(log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - max_bytes))
            return log.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read {log_path}: {exc.strerror})"


def wait_ready(process: subprocess.Popen, url: str, timeout_s: float, poll_s: float = 0.5,
               log_path: Path | None = None) -> None:
    """Block until the daemon's /ready answers 200; raise RuntimeError (killing it) if it exits or overstays
    `timeout_s`, with the end of its log (`start`'s) in the message."""
    try:
        wait_until_ready(lambda: answers_ready(url, timeout_s=2.0), timeout_s, poll_s=poll_s,
                         alive=lambda: process.poll() is None, what=f"the daemon at {url}")
    except (ExitedBeforeReady, NotReadyInTime) as exc:
        process.kill()
        process.wait()
        where = "" if log_path is None else f"; the end of its log {log_path}:\n{log_tail(log_path)}"
        raise RuntimeError(f"{exc}{where}") from None


def stop(process: subprocess.Popen | None, timeout_s: float = 60.0) -> None:
    """SIGTERM (the daemon drains), then SIGKILL if it overstays `timeout_s`; None: nothing was started."""
    if process is None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
