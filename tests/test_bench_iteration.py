"""`stallfree bench iteration` on the tiny model: its rows, the forward split and the weight bytes it reports."""
from __future__ import annotations

import json

from stallfree.bench import iteration
from stallfree.bench.op_breakdown import KINDS, weight_bytes_per_forward


def test_breakdown_rows_split_the_forward_and_count_weight_bytes(tmp_path, capsys):
    out = tmp_path / "it.json"
    assert iteration.main(["--model", "tiny", "--dtype", "float32", "--seqs", "1,4", "--iterations", "2",
                           "--context", "20", "--breakdown", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["seqs"] for r in result["rows"]] == [1, 4]
    assert result["memory_bandwidth_gb_s"] > 0
    for row in result["rows"]:
        split = row["forward_split_ms"]
        assert set(split) == set(KINDS)
        assert abs(sum(split.values()) - row["forward_ms"]) < 1e-2  # shares of the measured forward
        assert split["matmul"] > 0 and row["aten_ops_per_forward"] > 0
    assert "weights MB" in capsys.readouterr().out


def test_weight_bytes_count_every_dense_projection_and_the_tied_head():
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.models.loader import load_model

    model = load_model(ModelConfig(model="tiny")).model
    params = sum(p.numel() for name, p in model.named_parameters() if name.endswith("proj.weight"))
    head = model.embed_tokens.weight.numel() if model.lm_head is None else model.lm_head.weight.numel()
    assert weight_bytes_per_forward(model, rows=1) == 4 * (params + head)  # float32, no int4 copies


def test_mixed_rows_run_the_decodes_beside_a_chunk_over_a_prefix(tmp_path, capsys):
    out = tmp_path / "mixed.json"
    assert iteration.main(["--model", "tiny", "--dtype", "float32", "--seqs", "0,3", "--iterations", "2",
                           "--context", "20", "--chunk", "24", "--prefix", "40", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seqs"], r["chunk"], r["prefix"]) for r in rows] == [(0, 24, 40), (3, 24, 40)]
    for row in rows:  # the rate counts the chunk's tokens beside the decodes
        total_ms = row["prepare_ms"] + row["forward_ms"] + row["sample_ms"]
        assert abs(row["tokens_per_s"] - (row["seqs"] + 24) / total_ms * 1000) < 0.01 * row["tokens_per_s"] + 0.1
    assert "24-token chunk over a 40-token prefix" in capsys.readouterr().out
    assert iteration.main(["--model", "tiny", "--seqs", "0", "--json", ""]) == 2  # no decodes needs a chunk
