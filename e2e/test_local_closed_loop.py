"""The closed loop end to end: `stallfree up --demo` with real daemon processes (the sim backend), the
real control loop and real streaming load. The TPOT SLO is breached and restored by re-tuning, and
demand beyond one replica's prefill capacity scales the service out."""
from __future__ import annotations

import json

import pytest

from daemon_helpers import REPO
from stallfree.cli.up import main as up

pytestmark = pytest.mark.slow


def test_up_demo_restores_tpot_and_scales_out(tmp_path, capsys):
    manifest = REPO / "manifests/examples/llama-3-8b-sim.yaml"
    code = up(["-f", str(manifest), "--demo", "--phase-scale", "0.3", "--no-live", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    slo = report["slo"]["tpot_p99_ms"]
    rows = report["timeline"]
    reasons = [e["reason"] for e in report["events"]]

    # Re-tuning: the budget comes down from the ceiling it started at, and TPOT is under its SLO again
    # after every breach the loop saw.
    budgets = [d["token_budget"] for r in rows for d in r["replica_detail"] if d.get("token_budget")]
    assert budgets[0] == 2048 and min(budgets) < 1024
    assert "BudgetLowered" in reasons
    breaches = [i for i, r in enumerate(rows) if r["p99_tpot_ms"] is not None and r["p99_tpot_ms"] > slo]
    assert breaches, "the long prompts at the starting budget should breach the TPOT SLO"
    assert any(r["p99_tpot_ms"] is not None and r["p99_tpot_ms"] <= slo for r in rows[breaches[0] + 1:])

    # Scale-out when prefill capacity runs out.
    assert "ScaledUp" in reasons and max(r["desired_replicas"] for r in rows) >= 2
    assert max(r["ready_replicas"] for r in rows) >= 2

    # No accepted request vanished: each one completed (the routing only sends to ready replicas).
    total = report["client"]["all"]
    assert total["requests"] > 100 and total["failed"] == 0, total["errors"]
    assert "token budget: started 2048" in printed
