"""Rotary position embeddings (RoPE), Hugging Face convention (rotate_half over the two halves of a head).

Scaling follows the config's `rope_scaling`: none/"default", "linear" (positions divided by the factor)
and "llama3" (Llama-3.1's wavelength-dependent frequency scaling). The cos/sin table is built once, in
float32, for every position up to the model's context; a step only indexes it by position.
"""
from __future__ import annotations

import math

import torch

from stallfree.kernels.fused_ops import rope_rows, rope_tables

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type_of(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    # Older configs spell it "type", newer ones "rope_type".
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in float64, scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = rope_type_of(rope_scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama-3.1 reference implementation).
    factor = float(cfg["factor"])
    low_freq_factor = float(cfg.get("low_freq_factor", 1.0))
    high_freq_factor = float(cfg.get("high_freq_factor", 4.0))
    old_context = float(cfg.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to query and key rows [num_tokens, heads, head_dim] at their absolute positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, theta, rope_scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
        # cos and sin side by side, float32: one gather per step serves both.
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32)
        self.register_buffer("cos_sin_cache", cache.to(device) if device is not None else cache, persistent=False)
        self._rope_factors: torch.Tensor | None = None

    @property
    def rope_factors(self) -> torch.Tensor:
        """The same angles as full-width factors (cos, signed sin) [max_positions, 2, head_dim]: the lean
        formulation rope_rows takes. Made on first use, beside the cache: twice its size (64 MB a table at
        32k positions), and the compiled CPU forward, which reads cos_sin_cache, never asks for it."""
        factors = self._rope_factors
        if factors is None or factors.device != self.cos_sin_cache.device:
            factors = self._rope_factors = rope_tables(self.cos_sin_cache)
        return factors

    @property
    def max_positions(self) -> int:
        return self.cos_sin_cache.shape[0]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width cos and signed sin [num_tokens, 1, head_dim] for a step's positions (apply_rope's
        factors); computed once, used by every layer."""
        cos, sin = self.rope_factors.index_select(0, positions).unbind(1)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.lookup(positions)
        return apply_rope(query, cos, sin), apply_rope(key, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate rows [num_tokens, heads, head_dim] by their positions' angles (rotate_half convention), with
    lookup()'s factors; kernels/fused_ops.rope_rows holds the formula."""
    return rope_rows(x, cos, sin)
