"""The fused ops' torch paths compute exactly what the model's own layers compute (so a model may call them),
and the flashinfer path is only taken for CUDA tensors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stallfree.kernels import fused_ops
from stallfree.node_daemon.models.layers import RMSNorm
from stallfree.node_daemon.models.rope import RotaryEmbedding, apply_rope


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_model_layer(dtype):
    g = _gen()
    norm = RMSNorm(64, 1e-5, dtype, "cpu")
    norm.weight.data = torch.randn(64, generator=g).to(dtype)
    x = torch.randn(7, 64, generator=g).to(dtype)
    assert torch.equal(fused_ops.rms_norm(x, norm.weight, 1e-5), norm(x))
    r = torch.randn(7, 64, generator=g).to(dtype)
    normed, summed = fused_ops.fused_add_rms_norm(x.clone(), r.clone(), norm.weight, 1e-5)
    assert torch.equal(summed, x + r) and torch.equal(normed, norm(x + r))


def test_silu_and_mul_matches_swiglu():
    x = torch.randn(5, 2 * 24, generator=_gen())
    gate, up = x.split(24, dim=-1)
    assert torch.equal(fused_ops.silu_and_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_in_place_on_fused_qkv_views_matches_the_model(dtype):
    g = _gen()
    heads, kv_heads, d, n = 4, 2, 16, 9
    rotary = RotaryEmbedding(d, 128, 10000.0, None)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.randint(0, 128, (n,), generator=g)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(n, heads, d), k.view(n, kv_heads, d)
    cos, sin = rotary.lookup(positions)
    want_q, want_k = apply_rope(q.clone(), cos, sin), apply_rope(k.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    fused_ops.apply_rope_inplace(positions, q, k, rotary.cos_sin_cache)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # V untouched


def test_sampling_stays_inside_top_k_and_top_p():
    g = _gen()
    logits = torch.randn(4, 50, generator=g) * 3
    top_k = torch.tensor([1, 3, 50, 50])
    top_p = torch.tensor([1.0, 1.0, 1e-6, 0.5])
    draws = torch.stack([fused_ops.top_k_top_p_sample(logits, top_k, top_p, generator=g) for _ in range(300)])
    order = logits.argsort(dim=-1, descending=True)
    assert (draws[:, 0] == order[0, 0]).all()  # top_k 1: greedy
    assert set(draws[:, 1].tolist()) <= set(order[1, :3].tolist())
    assert (draws[:, 2] == order[2, 0]).all()  # a nucleus this small holds only the best token
    probs = logits[3].softmax(-1)[order[3]]
    nucleus = int(((probs.cumsum(0) - probs) < 0.5).sum())
    assert set(draws[:, 3].tolist()) <= set(order[3, :nucleus].tolist())


def test_flashinfer_path_only_for_cuda_tensors(monkeypatch):
    calls = []

    class FakeNorm:
        @staticmethod
        def rmsnorm(x, w, eps):
            calls.append("rmsnorm")
            return x

    class FakeFlashinfer:
        norm = FakeNorm

    monkeypatch.setattr(fused_ops, "_flashinfer", FakeFlashinfer)
    monkeypatch.setattr(fused_ops, "_unavailable", {})
    x = torch.randn(2, 8)
    fused_ops.rms_norm(x, torch.ones(8), 1e-6)  # a CPU tensor: torch path, the fake is never called
    assert calls == []


def test_switch_off_and_failure_fall_back_to_torch(monkeypatch):
    monkeypatch.setattr(fused_ops, "_flashinfer", None)
    monkeypatch.setattr(fused_ops, "_unavailable", {})
    monkeypatch.setenv("STALLFREE_FUSED_OPS", "0")
    assert fused_ops.flashinfer_module() is None
    assert "STALLFREE_FUSED_OPS=0" in fused_ops.unavailable_ops()["*"]
    fused_ops._give_up("rope", RuntimeError("no JIT module rope"))
    assert "no JIT module" in fused_ops.unavailable_ops()["rope"]
