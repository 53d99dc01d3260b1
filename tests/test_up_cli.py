"""`stallfree up`'s CLI is its flags and one call: the options reach the run typed, a bad manifest exits 2."""
from __future__ import annotations

from pathlib import Path

from stallfree.cli import up as up_cli
from stallfree.operator.local.closed_loop_run import RunOptions, demo_spec
from stallfree.operator.local.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
SIM = REPO / "manifests/examples/llama-3-8b-sim.yaml"


def test_the_flags_reach_the_run_as_options(monkeypatch, tmp_path, capsys):
    seen = {}

    async def fake_run(options, name, spec, out):
        seen.update(options=options, name=name, out=out)
        return {"service": name, "model": "m", "hardware": "cpu", "timeline": [], "events": [],
                "slo": {"tpot_p99_ms": 50.0}, "client": {}}

    monkeypatch.setattr(up_cli, "run", fake_run)
    code = up_cli.main(["-f", str(SIM), "--demo", "--duration", "12", "--no-live", "--phase-scale", "0.5",
                        "--interval", "2", "--start-timeout", "30", "--threads-per-replica", "2",
                        "--out", str(tmp_path)])
    assert code == 0
    assert seen["options"] == RunOptions(demo=True, duration_s=12.0, threads_per_replica=2, start_timeout_s=30.0,
                                         interval_s=2.0, live=False, phase_scale=0.5)
    assert seen["out"] == tmp_path and "== stallfree up:" in capsys.readouterr().out


def test_a_manifest_that_cannot_be_read_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Deployment\n")
    assert up_cli.main(["-f", str(bad)]) == 2
    assert "holds no InferenceService" in capsys.readouterr().err


def test_the_demo_starts_at_the_ceiling_budget_and_never_resumes(tmp_path, capsys):
    _, spec = load_manifest(str(SIM))
    (tmp_path / "control-state.json").write_text("{}")
    started = demo_spec(spec, tmp_path)
    assert started.engine.token_budget.initial == spec.engine.ceilings.max_token_budget
    assert not (tmp_path / "control-state.json").exists() and "starting from the spec" in capsys.readouterr().out
