"""`stallfree bench itl` against a live daemon: it prints both ITL rows and writes the JSON report."""
from __future__ import annotations

import json

from stallfree.bench import itl as bench_itl

from server_helpers import ADMIN_TOKEN, running_daemon


def test_bench_itl_against_a_live_daemon(tmp_path, capsys) -> None:
    out = tmp_path / "itl.json"
    with running_daemon() as live:
        rc = bench_itl.main(["--url", live.url, "--admin-token", ADMIN_TOKEN, "--streams", "6", "--max-tokens", "10",
                             "--prompt-tokens", "12", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "client-seen" in printed and "engine-side" in printed and "API overhead" in printed
    report = json.loads(out.read_text())
    assert report["streams"] == 6 and report["model"] == "tiny"
    assert report["engine_itl_ms"]["count"] == 6 * 9  # every stream's 9 gaps, exactly, on the engine side
    assert 0 < report["client_event_gap_ms"]["count"] <= 6 * 9
    assert 0 < report["events_per_output_token"] <= 1
    assert report["itl_overhead_ms"]["p99"] is not None or report["client_itl_ms"]["count"] == 0
