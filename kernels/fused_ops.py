"""The model's elementwise ops in one place (RMSNorm, add+RMSNorm, SiLU-and-mul, RoPE; top-k/top-p sampling):
flashinfer's fused kernels on CUDA, lean torch formulations everywhere else.

The model's layers (node_daemon/models/layers.py, rope.py, llama.py) call these; their formulas live
only here.

Where they pay: on the GPU each torch formulation below is several kernels that each read and write the
whole activation (RMSNorm in torch: cast, square, mean, rsqrt, two multiplies); the fused kernel reads
once and writes once, and under a CUDA graph the saved bytes are what remains of the cost. On the CPU
the torch path is used (flashinfer has no CPU kernels).

Every op takes the flashinfer path only for CUDA tensors with flashinfer importable and
STALLFREE_FUSED_OPS not set to 0. If a flashinfer kernel cannot be loaded (a missing JIT module on a
machine without nvcc, say), that op falls back to torch for the rest of the process and says so once.
The torch paths are Hugging Face's RMSNorm (torch's fused rms_norm: one op, mean square in float32),
SwiGLU and rotate-half RoPE in float32, each written with as few ops as the CPU needs (a step of a small
model on the CPU is bound by the number of ops as much as by their arithmetic).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_flashinfer = None  # the module, once imported
_unavailable: dict[str, str] = {}  # op -> why it runs in torch


def _enabled() -> bool:
    return os.environ.get("STALLFREE_FUSED_OPS", "1") not in ("0", "false", "no", "off")


def flashinfer_module():
    """flashinfer, or None when it is not installed or fused ops are switched off."""
    global _flashinfer
    if _flashinfer is None and "*" not in _unavailable:
        if not _enabled():
            _unavailable["*"] = "STALLFREE_FUSED_OPS=0"
            return None
        from stallfree.kernels.flashinfer_backend import import_flashinfer  # keeps flashinfer's CUDA RMSNorm

        try:
            _flashinfer = import_flashinfer()
        except ImportError as exc:
            _unavailable["*"] = f"flashinfer not importable: {exc}"
    return _flashinfer


def _use_flashinfer(op: str, t: torch.Tensor) -> bool:
    return t.is_cuda and op not in _unavailable and flashinfer_module() is not None


def _give_up(op: str, exc: Exception) -> None:
    _unavailable[op] = f"{type(exc).__name__}: {exc}"
    log.warning("fused op %s falls back to torch: %s", op, _unavailable[op])


def unavailable_ops() -> dict[str, str]:
    """Which fused ops run in torch on CUDA, and why (for the GPU check's report)."""
    return dict(_unavailable)


# --- RMSNorm ---------------------------------------------------------------------------------------------

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in weight's dtype (torch's fused rms_norm: one op, mean square in float32), returned in x's."""
    out = F.rms_norm(x if x.dtype == weight.dtype else x.to(weight.dtype), weight.shape, weight, eps)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, hidden] / rms(x) * weight."""
    if _use_flashinfer("rms_norm", x):
        try:
            return _flashinfer.norm.rmsnorm(x, weight, eps)
        except (RuntimeError, ImportError, OSError) as exc:
            _give_up("rms_norm", exc)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) in x's dtype, x + residual in the residual's dtype). The residual stream may be
    wider than x (float32 under bfloat16 layers on the CPU; weight then in float32 too). On the flashinfer
    path both inputs are overwritten in place."""
    if _use_flashinfer("fused_add_rms_norm", x):
        try:
            _flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps)
            return x, residual
        except (RuntimeError, ImportError, OSError) as exc:
            _give_up("fused_add_rms_norm", exc)
    summed = residual + x
    normed = F.rms_norm(summed, weight.shape, weight, eps)
    return (normed if normed.dtype == x.dtype else normed.to(x.dtype)), summed


# --- SwiGLU activation -----------------------------------------------------------------------------------

def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]."""
    if _use_flashinfer("silu_and_mul", x):
        try:
            return _flashinfer.activation.silu_and_mul(x)
        except (RuntimeError, ImportError, OSError) as exc:
            _give_up("silu_and_mul", exc)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- RoPE ------------------------------------------------------------------------------------------------

def rope_tables(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """[positions, head_dim] cos|sin halves -> [positions, 2, head_dim]: cos of both halves, then sin signed
    (-sin, sin), the full-width factors rope_rows multiplies by."""
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    return torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)], dim=1)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate rows [num_tokens, heads, head_dim] (rotate-half convention): x * cos + roll(x, D/2) * sin, with
    cos, sin the full-width factors [num_tokens, 1, head_dim] of rope_tables. Half-precision rows rotate in
    float32 (the tables' precision) and round once."""
    rotated = torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
    return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)


def _rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope_rows from half-width cos, sin [num_tokens, 1, head_dim // 2]."""
    return rope_rows(x, torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1))


def apply_rope_inplace(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> None:
    """Rotate query [n, heads, head_dim] and key [n, kv_heads, head_dim] in place (rotate-half convention).

    cos_sin_cache [max_positions, head_dim] float32: cos of each pair's angle in the first half, sin in the
    second (RotaryEmbedding.cos_sin_cache). query/key may be views into a fused QKV projection.
    """
    head_dim = query.shape[-1]
    if _use_flashinfer("rope", query):
        try:
            _flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
                positions, query.flatten(1), key.flatten(1), head_dim, cos_sin_cache, is_neox=True)
            return
        except (RuntimeError, ImportError, OSError) as exc:
            _give_up("rope", exc)
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    query.copy_(_rope_torch(query, cos, sin))
    key.copy_(_rope_torch(key, cos, sin))


# --- sampling --------------------------------------------------------------------------------------------

def top_k_top_p_sample(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of logits [rows, vocab] (temperature already applied), restricted to each row's
    top_k (vocab or more: no limit) and top-p nucleus. flashinfer samples by rejection without a sort."""
    if _use_flashinfer("sampling", logits):
        try:
            return _flashinfer.sampling.top_k_top_p_sampling_from_logits(
                logits, top_k, top_p, filter_apply_order="top_k_first", generator=generator).long()
        except (RuntimeError, ImportError, OSError) as exc:
            _give_up("sampling", exc)
    vocab = logits.shape[-1]
    sorted_logits, order = logits.float().sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    outside = ranks >= top_k.clamp(max=vocab).unsqueeze(1)
    probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(dim=-1)
    outside |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)  # mass before a token already covers top_p
    outside[:, 0] = False
    probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(dim=-1)
    picked = torch.multinomial(probs, 1, generator=generator)
    return order.gather(1, picked).squeeze(1)
