"""The GPU check's verdicts and exit status (e2e/gpu/gpu_report.py): a missed target, a failed check, a target
judged on nominal ceilings, an unmeasured one, a section that raised or did not run all make it exit non-zero."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e", "gpu"))

from gpu_report import Report  # noqa: E402

MEASURED = {"copy_bandwidth_bytes_s": 4.2e12, "bf16_matmul_flop_s": 760e12}


def measured_report(dry_run: bool = False) -> Report:
    report = Report(budget_s=60, dry_run=dry_run)
    report.run("ceilings", 0, lambda: report.set_ceilings(MEASURED, "test") or report.info("copy", "4.2 TB/s"))
    return report


def test_all_passing_with_measured_ceilings_exits_zero(tmp_path):
    report = measured_report()
    report.run("engine", 0, lambda: (report.correct("logits", "finite", True, "finite"),
                                     report.target("decode b=64", "1.1x floor", True, "<= 1.3x")))
    path = tmp_path / "r.json"
    assert report.finish(["ceilings", "engine"], str(path)) == 0
    data = json.loads(path.read_text())
    assert data["ceilings_source"] == "measured (test)" and data["problems"] == []


@pytest.mark.parametrize("add,verdict", [
    (lambda r: r.target("decode b=64", "1.6x floor", False, "<= 1.3x"), "FAIL"),
    (lambda r: r.correct("triton decodes", "rel err 3e-1", False, "< 1e-2"), "FAIL"),
    (lambda r: r.unmeasured("triton/flashinfer", "<= 1.5x", "no flashinfer timing"), "unmeasured"),
])
def test_a_missed_target_failed_check_or_unmeasured_target_exits_non_zero(add, verdict, capsys):
    report = measured_report()
    report.run("engine", 0, lambda: add(report))
    assert report.finish(["ceilings", "engine"], None) == 1
    row = report.data["sections"]["engine"]["rows"][0]
    assert row["verdict"] == verdict
    assert f"NOT MET  engine: {row['check']}: {verdict}" in capsys.readouterr().out


def test_targets_on_nominal_ceilings_are_unverified_not_passed(tmp_path, capsys):
    """The ceilings section skipped: a met target is still not a pass, and the table and JSON say why."""
    report = Report(budget_s=60)
    report.run("engine", 0, lambda: report.target("decode b=64", "1.1x floor", True, "<= 1.3x"))
    path = tmp_path / "r.json"
    assert report.finish(["engine"], str(path)) == 1
    data = json.loads(path.read_text())
    assert data["sections"]["engine"]["rows"][0]["verdict"] == "unverified"
    assert data["ceilings_source"].startswith("nominal")
    assert "targets judged against nominal" in capsys.readouterr().out


def test_a_section_that_raised_or_never_ran_or_said_nothing_exits_non_zero():
    report = measured_report()

    def boom():
        raise RuntimeError("illegal memory access")

    report.run("attention", 0, boom)
    report.run("fused_ops", 0, lambda: None)
    problems = report.problems(["ceilings", "attention", "fused_ops", "engine"])
    assert any("attention raised" in p for p in problems)
    assert any("engine did not run" in p for p in problems)
    assert any("fused_ops reported no rows" in p for p in problems)
    assert report.finish(["ceilings", "attention", "fused_ops", "engine"], None) == 1


def test_the_dry_run_shows_targets_without_judging_them_but_judges_correctness():
    report = measured_report(dry_run=True)
    report.run("engine", 0, lambda: report.target("decode b=4", "4000x floor", False, "<= 1.3x"))
    assert report.data["sections"]["engine"]["rows"][0]["verdict"] == "dry run"
    assert report.finish(["ceilings", "engine"], None) == 0
    report.run("correctness", 0, lambda: report.correct("triton decodes", "NaN left", False, "no NaN"))
    assert report.finish(["ceilings", "engine", "correctness"], None) == 1


def test_one_table_of_row_figure_target_verdict(capsys):
    report = measured_report()
    report.run("engine", 0, lambda: report.target("mixed 2048 tok", "0.61 of matmul", True, ">= 0.55"))
    report.finish(["ceilings", "engine"], None)
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("row ")))
    assert lines[header].split() == ["row", "figure", "target", "verdict"]
    assert lines[header + 3].split()[:3] == ["engine:", "mixed", "2048"] and lines[header + 3].endswith("pass")


def test_rows_belong_to_a_section():
    with pytest.raises(RuntimeError, match="inside a section"):
        Report(budget_s=1).info("loose", "1")
