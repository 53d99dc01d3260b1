"""`stallfree bench scheduler` runs its steady state and reports its figures (values are not asserted)."""
from __future__ import annotations

import json

from stallfree.cli.bench import main as bench_main


def test_bench_scheduler_prints_json_figures(capsys, tmp_path):
    out_file = tmp_path / "scheduler.json"
    argv = ["scheduler", "--running", "32", "--waiting", "64", "--token-budget", "256", "--num-blocks", "4096",
            "--warmup", "50", "--steps", "50", "--json", "--output", str(out_file)]
    assert bench_main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {"median_us", "p99_us", "update_median_us", "update_p99_us"} <= set(printed)
    assert printed["steps"] == 50 and printed["waiting"] == 64 and printed["finished"] >= 0
    assert 0 < printed["mean_running"] <= 32
    assert json.loads(out_file.read_text()) == printed
