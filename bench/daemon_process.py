"""A `stallfree serve` child process for the benchmarks that start their own daemon (itl, kv-estimate)."""
from __future__ import annotations

import signal
import subprocess
import time

import httpx

__all__ = ["stop", "wait_ready"]


def wait_ready(process: subprocess.Popen, url: str, timeout_s: float, poll_s: float = 0.5) -> None:
    """Block until the daemon's /ready answers 200; raise (killing it) if it exits or overstays `timeout_s`.

    The process must have been started with stderr=PIPE: its last lines are the error when it exits.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the daemon exited: {process.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    process.kill()
    raise RuntimeError(f"the daemon did not become ready within {timeout_s:.0f} s")


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
