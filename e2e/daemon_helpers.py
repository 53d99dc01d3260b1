"""Shared pieces of the end-to-end suites: real `stallfree serve` processes on loopback ports."""
from __future__ import annotations

import contextlib
import secrets
import time
from pathlib import Path
from typing import Iterator

import httpx

from stallfree.operator.local_daemons import LocalDaemonSet
from stallfree.operator.soak import SIM_DAEMON_ARGS

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def local_daemons(tmp_path: Path, replicas: int, args: list[str] = SIM_DAEMON_ARGS,
                  ready_timeout_s: float = 90.0) -> Iterator[LocalDaemonSet]:
    """`replicas` sim daemons, ready, stopped (drained) afterwards whatever happens."""
    daemons = LocalDaemonSet("e2e", list(args), secrets.token_urlsafe(12), tmp_path / "logs")
    daemons.scale_to(replicas)
    try:
        wait_ready(daemons, ready_timeout_s)
        yield daemons
    finally:
        daemons.shutdown()


def wait_ready(daemons: LocalDaemonSet, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(daemons.ready(r) for r in daemons.replicas):
            return
        time.sleep(0.2)
    raise AssertionError(f"daemons not ready after {timeout_s}s; logs in {daemons.log_dir}")
