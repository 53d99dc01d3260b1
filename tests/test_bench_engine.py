"""`stallfree bench engine --quick` against real sim daemons: every row of the table, in the JSON it writes."""
from __future__ import annotations

import json

import pytest

from stallfree.bench import engine as bench_engine
from stallfree.bench import engine_streams
from stallfree.cli.bench import BENCHMARKS


@pytest.mark.slow
def test_bench_engine_quick_on_the_sim_backend_writes_every_row(tmp_path, capsys) -> None:
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--quick", "--backend", "sim", "--model", "llama-3-8b", "--hardware", "h100",
                              "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["backend"] == "sim"
    assert set(data["rows"]) - {"single_stream_bandwidth"} == set(bench_engine.LABELS) == set(data["goals"])
    assert data["rows"]["single_stream_bandwidth"]["bytes_per_token"] is None  # a shape name: no GGUF file
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


def test_steady_gaps_leave_out_the_admission_of_later_streams() -> None:
    from stallfree.loadgen.stream import RequestResult

    def stream(started: float, ttft_ms: float, itl_ms: list[float]) -> engine_streams.Stream:
        result = RequestResult(0, 0, len(itl_ms) + 1, 0.0)
        result.ttft_ms, result.itl_ms = ttft_ms, itl_ms
        return engine_streams.Stream(result, started)

    # The first stream decodes at 10 ms a token, stalls 250 ms while the second one's prompt is prefilled,
    # then both decode at 20 ms; the first ends before the second.
    early = stream(0.0, 10.0, [10.0, 10.0, 250.0, 20.0, 20.0, 20.0])
    late = stream(0.0, 290.0, [20.0, 20.0, 20.0, 20.0, 20.0])
    assert max(engine_streams.all_gaps([early, late])) == 250.0
    steady = engine_streams.steady_gaps([early, late])
    assert steady and max(steady) == pytest.approx(20.0)


def test_the_printed_goals_are_checked():
    from stallfree.bench.engine import CHECKS, verdicts

    rows = {key: {"value": 1.0} for key in CHECKS}
    rows["single_stream_decode_tok_s"] = {"value": 130.0}
    rows["slo_landing"] = {"value": 1.0, "p99_gap_ms": 140.0, "max_gap_ms": 240.0, "ttft_vs_alone": 1.1}
    judged = verdicts(rows, judged=True)
    assert judged["single_stream_decode_tok_s"] == "met"
    assert judged["concurrent_total_tok_s"] == "MISSED"  # 1 tok/s against >= 560
    assert judged["slo_landing"] == "MISSED"  # max gap 240 > 225
    assert judged["startup_cached_s"] == "met" and judged["peak_rss_mb"] == "reported"
    assert set(verdicts(rows, judged=False).values()) <= {"not judged", "reported"}
