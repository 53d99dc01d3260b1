"""The local daemon set and runtime wait through the one ready loop: a replica that exits while starting is
named at once (with its log), not found at the deadline."""
from __future__ import annotations

import time

import pytest

from stallfree.operator.local.daemons import LocalDaemonSet
from stallfree.ready import ExitedBeforeReady


def test_a_replica_that_exits_while_starting_is_named_with_its_log(tmp_path):
    daemons = LocalDaemonSet("svc", ["--no-such-flag"], "token", tmp_path / "logs")  # `serve` exits at once
    daemons.scale_to(1)
    started = time.monotonic()
    try:
        with pytest.raises(ExitedBeforeReady, match=r"replica svc-0 \(its log: .*svc-0.log\) exited while starting"):
            daemons.wait_ready(timeout_s=120)
        assert time.monotonic() - started < 60
    finally:
        daemons.shutdown()


def test_an_empty_set_is_never_ready(tmp_path):
    assert LocalDaemonSet("svc", [], "token", tmp_path / "logs").wait_ready(timeout_s=0.2) is False
