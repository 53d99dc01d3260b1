"""`stallfree bench stall` on the tiny model: both modes measured, the JSON has the promised figures."""
from __future__ import annotations

import json

import torch

from stallfree.bench import stall as bench_stall


def test_bench_stall_reports_both_modes(tmp_path, capsys) -> None:
    out = tmp_path / "stall.json"
    argv = ["--model", "tiny", "--streams", "2", "--prompt-len", "200", "--chunked-budget", "48",
            "--json", "--output", str(out), "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert bench_stall.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(out.read_text())
    assert printed == saved
    chunked, unchunked = saved["chunked"], saved["unchunked"]
    for figures in (chunked, unchunked):
        assert {"max_gap_ms", "p99_gap_ms", "ttft_ms"} <= set(figures)
        assert 0 < figures["p99_gap_ms"] <= figures["max_gap_ms"]
    assert unchunked["iterations_to_first_token"] == 1 and unchunked["token_budget"] >= 200
    # 200 tokens at 48 - 2 decodes per iteration: the prefill takes ceil(200 / 46) iterations.
    assert chunked["iterations_to_first_token"] == 5
    assert chunked["decode_tokens_during_prefill"] >= 2 * 4  # the streams kept decoding meanwhile


def test_bench_stall_rejects_a_budget_too_small_for_unchunked(capsys) -> None:
    assert bench_stall.main(["--model", "tiny", "--prompt-len", "400", "--unchunked-budget", "100"]) == 2
    assert "--unchunked-budget" in capsys.readouterr().err
