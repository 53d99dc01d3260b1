"""`stallfree bench sampler` times every mix at every batch size and writes them as JSON (values not asserted)."""
from __future__ import annotations

import json

from stallfree.cli.bench import main as bench_main


def test_bench_sampler_writes_every_mix_and_batch(capsys, tmp_path):
    out_file = tmp_path / "sampler.json"
    argv = ["sampler", "--vocab", "2048", "--batch-sizes", "1", "4", "--warmup", "1", "--steps", "3",
            "--decode-step-ms", "50", "--json", str(out_file)]
    assert bench_main(argv) == 0
    printed = capsys.readouterr().out
    assert "one top-p row in a greedy batch of 4" in printed and "% of a 50 ms decode step" in printed
    results = json.loads(out_file.read_text())["results"]
    mixes = {r["mix"] for r in results}
    assert {"greedy", "greedy+1 top-p", "top-p 0.9", "top-k 50", "penalties", "greedy+1 logprobs"} == mixes
    assert len(results) == len(mixes) * 2
    assert all(r["median_us"] > 0 and r["p90_us"] >= r["median_us"] for r in results)
