"""kernels/fused_ops.py against float64 references written from the formulas (not from the model's layers, which
call fused_ops themselves), on both of its paths:

- the torch path, as the CPU runs it;
- the flashinfer path, taken here for CPU tensors with each call bound to the installed flashinfer's real
  signature and answered by the reference with flashinfer's documented semantics (in place where flashinfer
  works in place). That catches an argument flashinfer does not take, or a view that would be a copy (the
  in-place RoPE on a fused QKV projection), before a GPU run would. Skipped without flashinfer.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch

from stallfree.kernels import fused_ops


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def ref_rms_norm(x, w, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def ref_silu_and_mul(x):
    g, u = x.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


def cos_sin_cache(head_dim: int, positions: int, theta: float) -> torch.Tensor:
    """[positions, head_dim] float32: cos of each pair's angle, then sin (flashinfer's and RotaryEmbedding's layout)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def ref_rope(x, positions, cache):
    """Rotate-half RoPE: pair (i, i + d/2) turned by its angle at each token's position."""
    half = x.shape[-1] // 2
    cos, sin = cache[positions].double().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    a, b = x.double()[..., :half], x.double()[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rel(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_add_rms_norm_match_the_formula(dtype):
    g = _gen()
    x, r = torch.randn(9, 128, generator=g).to(dtype), torch.randn(9, 128, generator=g).to(dtype)
    w = torch.randn(128, generator=g).to(dtype)
    assert rel(fused_ops.rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5)) < TOL[dtype]
    normed, summed = fused_ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    assert torch.equal(summed, r + x)
    assert rel(normed, ref_rms_norm(summed, w, 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_formula(dtype):
    x = torch.randn(7, 2 * 96, generator=_gen()).to(dtype)
    assert rel(fused_ops.silu_and_mul(x), ref_silu_and_mul(x)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_fused_qkv_views_by_the_formula(dtype):
    from stallfree.node_daemon.models.rope import RotaryEmbedding

    g = _gen()
    heads, kv_heads, d, n = 4, 2, 32, 11
    cache = cos_sin_cache(d, 256, 10000.0)
    assert torch.allclose(RotaryEmbedding(d, 256, 10000.0, None).cos_sin_cache, cache, atol=1e-6)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.randint(0, 256, (n,), generator=g)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(n, heads, d), k.view(n, kv_heads, d)
    want_q, want_k, v_before = ref_rope(q, positions, cache), ref_rope(k, positions, cache), v.clone()
    fused_ops.apply_rope_inplace(positions, q, k, cache)
    assert rel(q, want_q) < TOL[dtype] and rel(k, want_k) < TOL[dtype]
    assert torch.equal(v, v_before)


def reference_nucleus(logits_row, top_k: int, top_p: float) -> dict[int, float]:
    """The top_k-first, then top-p distribution: token -> probability."""
    probs = logits_row.double().softmax(-1)
    order = probs.argsort(descending=True)[:top_k]
    kept = probs[order] / probs[order].sum()
    before = kept.cumsum(0) - kept
    keep = order[before < top_p]
    final = probs[keep] / probs[keep].sum()
    return dict(zip(keep.tolist(), final.tolist()))


def assert_draws_follow(draws: torch.Tensor, dist: dict[int, float]) -> None:
    n = draws.numel()
    assert set(draws.tolist()) == set(dist)  # every nucleus token drawn (each >= 5%), nothing outside
    for token, p in dist.items():
        freq = (draws == token).double().mean().item()
        assert abs(freq - p) < 6 * math.sqrt(p * (1 - p) / n) + 1e-9, (token, freq, p)


def test_top_k_top_p_sampling_follows_the_reference_distribution():
    g = _gen()
    # Eight plausible tokens (each >= 5% inside the nucleus), the rest far below.
    logits = torch.full((3, 64), -20.0)
    logits[:, :8] = torch.randn(3, 8, generator=g) * 0.3
    top_k = torch.tensor([64, 5, 8])
    top_p = torch.tensor([1.0, 1.0, 0.6])
    reps = 3000  # one call over the rows repeated: independent draws per row
    draws = fused_ops.top_k_top_p_sample(logits.repeat(reps, 1), top_k.repeat(reps), top_p.repeat(reps),
                                         generator=g).view(reps, 3)
    for row in range(3):
        dist = reference_nucleus(logits[row], int(top_k[row]), float(top_p[row]))
        dist = {t: p for t, p in dist.items() if p > 1e-6}
        assert_draws_follow(draws[:, row], dist)


# --- the flashinfer path, through the real signatures -----------------------------------------------------

class BoundFlashinfer:
    """flashinfer's five entry points, each call bound to the real signature, answered by the references."""

    def __init__(self, real) -> None:
        self.calls: list[str] = []
        outer = self

        def bind(fn, *args, **kwargs):
            inspect.signature(fn).bind(*args, **kwargs)
            outer.calls.append(fn.__name__)

        class Norm:
            @staticmethod
            def rmsnorm(*args, **kwargs):
                bind(real.norm.rmsnorm, *args, **kwargs)
                x, w, eps = args
                return ref_rms_norm(x, w, eps).to(x.dtype)

            @staticmethod
            def fused_add_rmsnorm(*args, **kwargs):
                bind(real.norm.fused_add_rmsnorm, *args, **kwargs)
                x, residual, w, eps = args
                residual.add_(x)  # documented: residual += input; input = rmsnorm(residual), both in place
                x.copy_(ref_rms_norm(residual, w, eps))

        class Activation:
            @staticmethod
            def silu_and_mul(*args, **kwargs):
                bind(real.activation.silu_and_mul, *args, **kwargs)
                return ref_silu_and_mul(args[0]).to(args[0].dtype)

        class Rope:
            @staticmethod
            def apply_rope_with_cos_sin_cache_inplace(*args, **kwargs):
                bind(real.rope.apply_rope_with_cos_sin_cache_inplace, *args, **kwargs)
                positions, query, key, head_size, cache = args
                assert kwargs.get("is_neox") is True  # rotate-half: the model's convention
                for t in (query, key):  # [n, heads * head_size], written in place
                    t.copy_(ref_rope(t.view(t.shape[0], -1, head_size), positions, cache).flatten(1))

        class Sampling:
            @staticmethod
            def top_k_top_p_sampling_from_logits(*args, **kwargs):
                bind(real.sampling.top_k_top_p_sampling_from_logits, *args, **kwargs)
                assert kwargs.get("filter_apply_order") == "top_k_first"
                logits, top_k, top_p = args
                return torch.stack([torch.tensor(max(reference_nucleus(logits[i], int(top_k[i]), float(top_p[i])).items(),
                                                     key=lambda kv: kv[1])[0]) for i in range(logits.shape[0])]).int()

        self.norm, self.activation, self.rope, self.sampling = Norm, Activation, Rope, Sampling


@pytest.fixture
def flashinfer_path(monkeypatch):
    real = pytest.importorskip("flashinfer", reason="flashinfer-python not installed (the gpu extra)")
    bound = BoundFlashinfer(real)
    monkeypatch.setattr(fused_ops, "_flashinfer", bound)
    monkeypatch.setattr(fused_ops, "_unavailable", {})
    monkeypatch.setattr(fused_ops, "_use_flashinfer", lambda op, t: op not in fused_ops._unavailable)
    return bound


def test_flashinfer_path_calls_bind_and_compute_the_formulas(flashinfer_path):
    g = _gen()
    x, r = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g).bfloat16()
    assert rel(fused_ops.rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5)) < 1e-2
    normed, summed = fused_ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    assert torch.equal(summed, r + x) and rel(normed, ref_rms_norm(r + x, w, 1e-5)) < 1e-2
    gate_up = torch.randn(5, 128, generator=g).bfloat16()
    assert rel(fused_ops.silu_and_mul(gate_up), ref_silu_and_mul(gate_up)) < 1e-2

    heads, kv_heads, d, n = 4, 2, 32, 6
    cache = cos_sin_cache(d, 128, 10000.0)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).bfloat16()
    positions = torch.randint(0, 128, (n,), generator=g)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(n, heads, d), k.view(n, kv_heads, d)
    want_q, want_k = ref_rope(q, positions, cache), ref_rope(k, positions, cache)
    fused_ops.apply_rope_inplace(positions, q, k, cache)
    assert rel(q, want_q) < 1e-2 and rel(k, want_k) < 1e-2  # the rotation reached the QKV buffer itself

    logits = torch.randn(4, 50, generator=g)
    picked = fused_ops.top_k_top_p_sample(logits, torch.full((4,), 5), torch.full((4,), 0.9))
    assert picked.dtype == torch.int64 and torch.equal(picked, logits.argmax(-1))
    assert flashinfer_path.calls == ["rmsnorm", "fused_add_rmsnorm", "silu_and_mul",
                                     "apply_rope_with_cos_sin_cache_inplace", "top_k_top_p_sampling_from_logits"]


def test_flashinfer_keeps_its_cuda_rmsnorm_whichever_module_imports_it_first():
    """flashinfer.norm picks RMSNorm at import; backend selection usually imports flashinfer before any fused op."""
    import subprocess
    import sys

    pytest.importorskip("flashinfer", reason="flashinfer-python not installed (the gpu extra)")
    # What FLASHINFER_USE_CUDA_NORM says at the moment flashinfer.norm is imported (here cutlass-dsl may be absent,
    # which would make flashinfer fall back by itself: the variable is what counts where it is installed).
    code = ("import os, sys, importlib.abc, torch; os.environ.pop('FLASHINFER_USE_CUDA_NORM', None)\n"
            "class Seen(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'flashinfer.norm': print('at import:', os.environ.get('FLASHINFER_USE_CUDA_NORM'))\n"
            "sys.meta_path.insert(0, Seen())\n"
            "from stallfree.kernels.selection import flashinfer_usable\n"
            "try:\n    flashinfer_usable(torch.device('cuda'))\nexcept Exception:\n    pass  # no GPU here\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "at import: 1" in done.stdout, done.stdout + done.stderr[-2000:]
