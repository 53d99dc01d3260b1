"""`stallfree bench engine --quick` against real sim daemons: every row of the table, in the JSON it writes."""
from __future__ import annotations

import json

import pytest

from stallfree.bench import engine as bench_engine
from stallfree.cli.bench import BENCHMARKS


@pytest.mark.slow
def test_bench_engine_quick_on_the_sim_backend_writes_every_row(tmp_path, capsys) -> None:
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--quick", "--backend", "sim", "--model", "llama-3-8b", "--hardware", "h100",
                              "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["backend"] == "sim"
    assert set(data["rows"]) == set(bench_engine.LABELS) == set(data["goals"])
    rows = data["rows"]
    for key in ("single_stream_decode_tok_s", "concurrent_total_tok_s", "prefill_tok_s", "startup_cold_s",
                "startup_cached_s", "peak_rss_mb"):
        assert rows[key]["value"] > 0, key
    concurrent = rows["concurrent_total_tok_s"]
    assert concurrent["p99_gap_ms"] > 0 and concurrent["max_gap_ms"] >= concurrent["p99_gap_ms"]
    for key in ("landing_max_gap_ms", "slo_landing"):
        assert all(run["gaps_during"] > 0 for run in rows[key]["runs"]), key  # the streams decoded meanwhile
        assert rows[key]["ttft_ms"] > 0
    assert rows["slo_landing"]["chosen_token_budget"] >= 1 and rows["slo_landing"]["ttft_vs_alone"] > 0
    assert rows["startup_cached_s"]["cache_hits"] == [True, True]  # the later daemons read the first one's profile
    assert rows["peak_rss_mb"]["kv_blocks"] > 0
    for key, label in bench_engine.LABELS.items():
        assert label.format(**data["sizes"]) in printed  # one printed row each, goal beside it
        assert bench_engine.GOALS[key] in printed


def test_bench_engine_is_registered() -> None:
    assert BENCHMARKS["engine"][0] == "stallfree.bench.engine"
