"""The one-stream row's memory reading (bench/weight_bytes.py): the GGUF file's bytes a token, GB/s and the share of
the machine's bandwidth."""
from __future__ import annotations

from stallfree.bench.weight_bytes import bandwidth_row, describe, gguf_bytes_per_token, gguf_of
from stallfree.node_daemon.models.gguf_file import GGUFFile


def test_a_tied_file_is_read_whole_a_token():
    path = gguf_of("smollm2-135m")
    assert path is not None and path.endswith(".gguf") and gguf_of("tiny") is None
    total = sum(t.data.nbytes for t in GGUFFile(path).tensors)
    assert gguf_bytes_per_token(path) == total  # SmolLM2 ties its embedding: the head reads it whole


def test_gb_s_and_the_share_of_the_machine():
    row = bandwidth_row(100.0, 250_000_000, 30.0)
    assert row["gb_s"] == 25.0 and row["share"] == round(25 / 30, 3) and row["bound_tok_s"] == 120.0
    assert "25.0 GB/s read of the machine's 30.0 GB/s (83%" in describe(row)
    assert bandwidth_row(None, 250_000_000, 30.0)["gb_s"] is None
    assert describe(bandwidth_row(100.0, None, 30.0)).startswith("- (no GGUF file")


def test_a_run_without_a_one_stream_row_prints_the_bytes_alone():
    """--serving-only measures no one-stream speed: the line gives the bytes a token, and no share of nothing."""
    assert describe(bandwidth_row(None, 250_000_000, 30.0)) == "250 MB a token"
