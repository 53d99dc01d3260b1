"""bench/write_random_gguf.py: a small version of the random Llama-3.2-1B-shaped GGUF loads and runs from its codes
(every projection quantized, none dequantized at load), for Q4_0 and the Q4_K_M mix, with the embedded tokenizer."""
from __future__ import annotations

import logging

import pytest
import torch

from model_helpers import make_request, prefill_all_rows, relative_error, step
from stallfree.bench import write_random_gguf
from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.models.layers import Linear
from stallfree.node_daemon.models.loader import load_model

# bfloat16 with quantized weights against the float32 dequantized model: max |logit error| / max |logit|, as in
# tests/test_quantized.py
BF16_LOGIT_TOLERANCE = 0.05
HIDDEN, LAYERS = 256, 8  # 8 layers: Q4_K_M gives layers 0, 3, 6 and 7 more bits, not the others


@pytest.fixture(autouse=True)
def _no_weight_cache(monkeypatch):
    monkeypatch.setenv("STALLFREE_WEIGHT_CACHE", "off")


def test_q4_k_m_mix_follows_llama_cpp():
    types = {name: qtype for name, _, qtype in write_random_gguf.plan(2048, 16, 49152, "q4_k_m")}
    assert types["token_embd.weight"] == "Q6_K" and types["output_norm.weight"] == "F32"
    more_bits = [i for i in range(16) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"]
    assert more_bits == [0, 1, 4, 7, 10, 13, 14, 15]
    assert all(types[f"blk.{i}.ffn_down.weight"] == "Q6_K" for i in more_bits)
    assert {types[f"blk.3.{p}.weight"] for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                 "ffn_down")} == {"Q4_K"}
    assert {q for n, _, q in write_random_gguf.plan(2048, 16, 49152, "q4_0") if not n.endswith("norm.weight")} \
        == {"Q4_0"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """kind -> the small file, written once through the command line's entry point."""
    paths: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in paths:
            path = str(tmp_path_factory.mktemp("gguf") / f"small-{kind}.gguf")
            assert write_random_gguf.main(["--type", kind, "--hidden", str(HIDDEN), "--layers", str(LAYERS),
                                           "--out", path]) == 0
            paths[kind] = path
        return paths[kind]
    return get


@pytest.mark.parametrize("kind, types", [("q4_0", "Q4_0"), ("q4_k_m", "Q4_K, Q6_K")])
def test_small_random_gguf_loads_from_its_codes(written, caplog, kind, types):
    path = written(kind)
    with caplog.at_level(logging.INFO, logger="stallfree.node_daemon.models.gguf_loader"):
        loaded = load_model(ModelConfig(model=path, dtype="bfloat16"))
    shape = loaded.shape
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == \
        (HIDDEN, LAYERS, 4, 1, 64)
    assert shape.vocab_size == 49152 and shape.tie_word_embeddings and shape.rope_theta == 500000.0
    assert shape.max_position_embeddings == 8192
    assert loaded.tokenizer_metadata["tokenizer.ggml.model"] == "gpt2"  # the embedded SmolLM2 tokenizer's fields
    model = loaded.model
    projections = [name for name, m in model.named_modules() if isinstance(m, Linear)]
    assert len(projections) == 4 * LAYERS  # qkv, o, gate_up, down
    assert [name for name, m in model.named_modules() if isinstance(m, Linear) and m.int4 is None] == []
    assert model.tied_lm_head_int4 is not None
    line = next(r.getMessage() for r in caplog.records if "served from their GGUF codes" in r.getMessage())
    assert f"({types})" in line and "0 projections dense" in line and "dequantized types" not in line
    if kind == "q4_k_m":  # layer 0's v is Q6_K beside Q4_K q and k: the fused qkv is held as 8-bit codes
        assert model.layers[0].self_attn.qkv_proj.int4.tiles.bits == 8
        assert model.layers[1].self_attn.qkv_proj.int4.tiles.bits == 4
    logits = _logits(loaded)
    assert logits.shape == (20, 49152) and torch.isfinite(logits).all() and logits.float().std() > 0
    # the codes served in bfloat16 against gguf's own dequantization in float32 (the reference path)
    reference = _logits(load_model(ModelConfig(model=path, dtype="float32")))
    assert relative_error(logits, reference) < BF16_LOGIT_TOLERANCE


def _logits(loaded) -> torch.Tensor:
    runner = ModelRunner(ModelConfig(), CacheConfig(block_size=16, num_blocks=4), max_num_tokens=64, max_num_seqs=2,
                         loaded=loaded)
    return prefill_all_rows(runner, make_request("r", list(range(1, 21)), [0, 1]), chunk_size=20)


@pytest.mark.parametrize("kind", ["q4_0", "q4_k_m"])
def test_compiled_decode_on_the_codes_follows_float32(written, kind):
    """The compiled forward's code kernel on these tiles (4-bit Q4_K, 8-bit Q6_K and widened q/k, signed scales)
    against gguf's dequantization in float32, one decode step after a 20-token prompt."""
    from stallfree.node_daemon.models import cpu_decode

    if not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled decode path unavailable: {cpu_decode.why_not()}")
    path, ids, rows = written(kind), list(range(100, 121)), []
    for config in (ModelConfig(model=path, dtype="float32"),
                   ModelConfig(model=path, dtype="bfloat16", compiled_decode="now")):
        runner = ModelRunner(config, CacheConfig(block_size=16, num_blocks=4), max_num_tokens=64, max_num_seqs=2)
        req = make_request("d", ids[:-1], [0, 1])
        prefill_all_rows(runner, req, len(ids) - 1)
        req.append_output_token(ids[-1])
        rows.append(step(runner, [ScheduledChunk(req, req.num_tokens - 1, 1, is_prefill=False, samples=True)]))
    assert runner.cpu_decode is not None
    assert torch.isfinite(rows[1]).all() and relative_error(rows[1], rows[0]) < BF16_LOGIT_TOLERANCE


def test_a_shape_that_k_quants_cannot_hold_is_refused(tmp_path, capsys):
    assert write_random_gguf.main(["--hidden", "320", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "multiple of 256" in capsys.readouterr().err
