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
