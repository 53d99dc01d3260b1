"""Memory: a prepacked model can drop its plain dense projection weights (same logits, export refused), and the
CPU KV cache is resident only where it is written (zero everywhere, RSS not grown by its size up front, nor by a
huge page per first write)."""
from __future__ import annotations

import pytest
import torch

from model_helpers import needs_onednn_bf16
from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.engine.model_runner import ModelRunner, _lazily_zeroed
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.models.layers import Linear
from stallfree.node_daemon.models.loader import load_model


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@needs_onednn_bf16()
def test_released_dense_weights_serve_the_same_logits_and_refuse_export():
    kept = load_model(ModelConfig(model="tiny", dtype="bfloat16")).model
    released = load_model(ModelConfig(model="tiny", dtype="bfloat16", release_dense_weights=True)).model
    rows = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, kept.shape.hidden_size, generator=rows).bfloat16()
    for a, b in zip([m for m in kept.modules() if isinstance(m, Linear)],
                    [m for m in released.modules() if isinstance(m, Linear)]):
        if b is not released.lm_head:  # an untied head keeps its weight (the logits' float32 refinement reads it)
            assert b.weight.device.type == "meta" and b.weight.shape == a.weight.shape  # shape kept, storage gone
        x = torch.randn(24, a.in_features, generator=rows).bfloat16()
        assert torch.equal(a(x), b(x))
    assert torch.equal(kept.compute_logits(hidden), released.compute_logits(hidden))
    with pytest.raises(RuntimeError, match="released"):
        dict(released.hf_weights())
    with pytest.raises(RuntimeError, match="released"):
        released.load_weights([])


def test_float32_models_have_nothing_to_release():
    model = load_model(ModelConfig(model="tiny", dtype="float32", release_dense_weights=True)).model
    assert not model.dense_released and model.layers[0].mlp.down_proj.weight.device.type == "cpu"


def test_the_cpu_kv_cache_is_zero_and_resident_only_where_written():
    size = 256 << 20
    before = _rss_bytes()
    cache = _lazily_zeroed((2, size // 4), torch.bfloat16)
    assert _rss_bytes() - before < size // 4  # not written up front (torch.zeros would add all of it)
    assert cache.dtype == torch.bfloat16 and cache.shape == (2, size // 4)
    assert torch.count_nonzero(cache[:, :4096]) == 0 and torch.count_nonzero(cache[:, -4096:]) == 0
    before = _rss_bytes()
    for row in range(0, size // 4, size // 64):  # 16 planes apart, as the KV cache's (layer, k/v, head) planes are
        cache[0, row] = 1.0
    assert _rss_bytes() - before < 1 << 20  # small pages: a first write is not a 2 MiB huge page zeroed
    assert float(cache[0].sum()) == 16.0


def test_a_cpu_runner_allocates_its_kv_cache_lazily():
    before = _rss_bytes()
    runner = ModelRunner(ModelConfig(model="tiny"), CacheConfig(block_size=16, num_blocks=16384), max_num_tokens=64,
                         max_num_seqs=4)
    k, v = runner.kv_caches[0]
    cache_bytes = k.numel() * k.element_size() * 2 * len(runner.kv_caches)
    assert cache_bytes > 64 << 20 and _rss_bytes() - before < cache_bytes // 2


def test_a_tied_embedding_is_looked_up_in_its_codes_once_its_table_is_released(monkeypatch):
    """SmolLM2's tied embedding (Q8_0 in its file): released, its rows come from the head's code tiles (the Python
    path's TiledCodes.rows and the compiled forward's code_rows alike), the same bfloat16 values the table held, and
    the weight cache keeps no table either."""
    monkeypatch.setenv("STALLFREE_WEIGHT_CACHE", "off")
    kept = load_model(ModelConfig(model="smollm2-135m", dtype="bfloat16")).model
    released = load_model(ModelConfig(model="smollm2-135m", dtype="bfloat16", release_dense_weights=True)).model
    assert released.embed_tokens.weight.device.type == "meta" and released.device.type == "cpu"
    ids = torch.tensor([0, 1, 17, 4095, 49151, 17])
    want = kept.embed_tokens(ids)
    assert torch.equal(released.embed(ids), want)
    from stallfree.node_daemon.models import cpu_decode

    if cpu_decode.ensure_built(background=False):
        assert torch.equal(cpu_decode.ops().code_rows(released.embed_codes.blocks, ids), want)
    hidden = torch.randn(3, kept.shape.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(kept.compute_logits(hidden).argmax(-1), released.compute_logits(hidden).argmax(-1))
