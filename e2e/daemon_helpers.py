"""Shared pieces of the end-to-end suites: real `stallfree serve` processes on loopback ports."""
from __future__ import annotations

import contextlib
import secrets
from pathlib import Path
from typing import Iterator

from stallfree.operator.local.daemons import LocalDaemonSet
from stallfree.bench.soak import SIM_DAEMON_ARGS

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def local_daemons(tmp_path: Path, replicas: int, args: list[str] = SIM_DAEMON_ARGS,
                  ready_timeout_s: float = 90.0) -> Iterator[LocalDaemonSet]:
    """`replicas` sim daemons, ready, stopped (drained) afterwards whatever happens."""
    daemons = LocalDaemonSet("e2e", list(args), secrets.token_urlsafe(12), tmp_path / "logs")
    daemons.scale_to(replicas)
    try:
        assert daemons.wait_ready(ready_timeout_s), f"daemons not ready; logs in {daemons.log_dir}"
        yield daemons
    finally:
        daemons.shutdown()

