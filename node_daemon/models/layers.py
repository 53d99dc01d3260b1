"""The small layers a Llama-family decoder is made of: linear projections, RMSNorm, SwiGLU (GELU-tanh for Gemma).

Parameters are created empty (no init pass over billions of weights): a loader fills them from a
checkpoint or random_weights draws them. Every layer works on flattened rows [num_tokens, ...].
A Linear may also carry its GGUF weight packed as int4 (models/quantized.py), taken by iterations of
at most INT4_MAX_ROWS rows, and on a CPU in bfloat16 its dense weight prepacked for oneDNN (prepack_for_cpu),
taken by the larger ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stallfree.kernels.fused_ops import rms_norm, silu_and_mul
from stallfree.node_daemon.models.quantized import INT4_MAX_ROWS, Int4Weight


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features] as in Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.int4: Int4Weight | None = None  # set by the GGUF loader where the weight maps exactly
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout (prepack_for_cpu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Past INT4_MAX_ROWS the oneDNN copy where there is one (AVX-512) and the code kernel's row limit is passed
        # (cpu_decode.code_max_rows), else still the codes (no dense copy).
        rows = x.shape[0]
        if self.int4 is not None and (rows <= INT4_MAX_ROWS or self.packed is None
                                      or self.int4.code_kernel_applies(rows)):
            y = self.int4.matmul(x, any_rows=self.packed is None)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def prepack_for_cpu(self) -> None:
        """The oneDNN copy, from the dense weight, or from the codes where the dense weight was never decoded."""
        if self.weight.device.type == "meta" and self.int4 is not None:
            from stallfree.node_daemon.models.cpu_decode import dequantize_tiles

            self.packed = prepack_weight(dequantize_tiles(self.int4.tiles, self.weight.dtype))
        else:
            self.packed = prepack_weight(self.weight)


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked bfloat16 matmul: CPU, bfloat16, torch built with mkldnn, a tier whose oneDNN runs
    bfloat16 (AVX-512: below it oneDNN refuses the reorder)."""
    from stallfree.node_daemon.models.cpu_tier import cpu_tier

    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and cpu_tier().onednn_bf16)


def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] reordered once into oneDNN's blocked layout. F.linear reorders it on every call; that is
    25-35% of a 16-row matmul's time here (3072x576 bfloat16: 297 against 455 us a call), 5-10% of a prefill's.
    The batch-size hint 16 is the decode batches' (measured no worse for prefill's hundreds of rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ W^T (+ b) with a prepacked W: the same values as F.linear (oneDNN either way)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean square taken in float32 (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [2 * intermediate, hidden] matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class GeluTanhGLU(SwiGLU):
    """Gemma's MLP: down(gelu_tanh(gate(x)) * up(x)), gate and up fused as in SwiGLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
