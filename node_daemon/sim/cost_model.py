"""Iteration time of one batch: a roofline over a model shape and a device, or a measured profile.

A batch is its decodes (each one new token, given by its context length including that token) and its
prefill chunks (prefix_len tokens already in the KV cache, num_tokens computed now). The roofline, at the
hardware's achieved FLOP rate and bandwidth:

  compute   = (2 x matmul params x tokens + 2 x LM head params x sampled rows) / FLOP rate
  memory    = weight bytes / bandwidth
  linear    = (compute^p + memory^p)^(1/p), p the hardware's knee (inf: max(compute, memory))
  attention = per sequence, max(attention FLOPs / FLOP rate, KV bytes / bandwidth), summed
  total     = linear + attention + fixed overhead

The knee is fitted with the efficiencies to measured linear-layer times (hardware.py): near the ridge
point a GEMM is slower than both its compute and its memory bound.

Attention FLOPs per layer are 4 x heads x head_dim x (query, key) pairs; a chunk's queries see its whole
prefix plus the causal part of the chunk (n x p + n(n+1)/2 pairs). KV bytes are the prefix re-read plus
the chunk's own KV written, so a prompt cut in chunks pays for re-reading earlier chunks. Activations'
traffic and the embedding lookup are left out: both are small beside weights and KV at serving sizes.

Pure Python and lean: the scheduler may call predict_ms several times per iteration to size chunks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

from stallfree.contracts import Profile, ProfilePoint
from stallfree.shapes import ModelShape
from stallfree.node_daemon.sim.hardware import Hardware

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "auto": 2}


class IterationCostModel(Protocol):
    """What the scheduler (time-target chunking) and the sim backend ask of a cost model."""

    def predict_ms(self, decode_context_lens: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float: ...


@dataclass(frozen=True)
class IterationCost:
    """The roofline's terms for one batch, in milliseconds (for reports and tests; predict_ms is the lean path)."""

    linear_compute_ms: float
    weight_read_ms: float
    linear_ms: float  # the two above through the knee
    attention_ms: float
    overhead_ms: float

    @property
    def total_ms(self) -> float:
        return self.linear_ms + self.attention_ms + self.overhead_ms


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


class RooflineCostModel:
    """Iteration time from a ModelShape and a Hardware (see the module docstring for the formula)."""

    def __init__(self, shape: ModelShape, hardware: Hardware, weight_dtype_bytes: int = 2,
                 kv_dtype_bytes: int | None = None) -> None:
        self.shape = shape
        self.hardware = hardware
        self.weight_dtype_bytes = weight_dtype_bytes
        self.kv_dtype_bytes = weight_dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        h, d = shape.hidden_size, shape.head_dim
        per_layer = (h * shape.num_heads * d + 2 * h * shape.num_kv_heads * d + shape.num_heads * d * h
                     + 3 * h * shape.intermediate_size)
        self.matmul_params_per_token = shape.num_layers * per_layer
        self.layer_weight_bytes = (per_layer + 2 * h) * weight_dtype_bytes  # its matrices and its two norms
        self.lm_head_params = shape.vocab_size * h
        # Read every step: all weights but an untied embedding table (only the batch's rows are looked up).
        self.weight_read_params = shape.num_parameters - (0 if shape.tie_word_embeddings else self.lm_head_params)
        self.kv_bytes_per_token = shape.kv_bytes_per_token(self.kv_dtype_bytes)
        self.attention_flops_per_pair = 4 * shape.num_heads * d * shape.num_layers

        flops, bw = hardware.flops_per_s, hardware.bytes_per_s
        # Precomputed seconds per unit so the hot path is a few multiply-adds.
        self._s_per_flop = 1.0 / flops
        self._weight_read_s = self.weight_read_params * weight_dtype_bytes / bw
        self._pair_s = self.attention_flops_per_pair / flops
        self._kv_token_s = self.kv_bytes_per_token / bw
        # A decode attends to c keys with c KV entries moved: its time is linear in c.
        self._decode_ctx_s = max(self._pair_s, self._kv_token_s)
        self._overhead_s = hardware.overhead_ms / 1000.0
        knee = hardware.knee
        self._knee = None if math.isinf(knee) else knee  # None: the plain max
        if self._knee is not None:
            if knee < 1:
                raise ValueError(f"the knee must be at least 1 (1 adds compute and memory), got {knee}")
            self._inv_knee = 1.0 / knee
            self._weight_read_pow = self._weight_read_s ** knee

    @property
    def weight_bytes(self) -> int:
        return self.weight_read_params * self.weight_dtype_bytes

    def linear_flops(self, num_tokens: int, num_sampled: int) -> int:
        return 2 * self.matmul_params_per_token * num_tokens + 2 * self.lm_head_params * num_sampled

    def predict_ms(self, decode_context_lens: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        num_decodes = len(decode_context_lens)
        if not num_decodes and not prefill_chunks:
            return 0.0
        tokens = num_decodes
        attention_s = sum(decode_context_lens) * self._decode_ctx_s
        pair_s, kv_token_s = self._pair_s, self._kv_token_s
        for prefix_len, num_tokens in prefill_chunks:
            tokens += num_tokens
            pairs = num_tokens * prefix_len + num_tokens * (num_tokens + 1) // 2
            compute_s = pairs * pair_s
            memory_s = (prefix_len + num_tokens) * kv_token_s
            attention_s += compute_s if compute_s > memory_s else memory_s
        # Logits are computed for the last position of each sequence only.
        compute_s = self.linear_flops(tokens, num_decodes + len(prefill_chunks)) * self._s_per_flop
        knee = self._knee
        if knee is None:
            linear_s = compute_s if compute_s > self._weight_read_s else self._weight_read_s
        else:
            linear_s = (compute_s ** knee + self._weight_read_pow) ** self._inv_knee
        return (linear_s + attention_s + self._overhead_s) * 1000.0

    def linear_ms(self, compute_ms: float, memory_ms: float) -> float:
        """Compute and memory time of linear layers through the hardware's knee."""
        if self._knee is None:
            return max(compute_ms, memory_ms)
        return (compute_ms ** self._knee + memory_ms ** self._knee) ** self._inv_knee

    def layer_linear_ms(self, num_tokens: int) -> float:
        """One decoder layer's non-attention time for `num_tokens` tokens (what calibration data measures)."""
        per_layer = self.matmul_params_per_token // self.shape.num_layers
        return self.linear_ms(2 * per_layer * num_tokens * self._s_per_flop * 1000.0,
                              self.layer_weight_bytes / self.hardware.bytes_per_s * 1000.0)

    def breakdown(self, decode_context_lens: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> IterationCost:
        """The same prediction split into its terms."""
        tokens = len(decode_context_lens) + sum(n for _, n in prefill_chunks)
        sampled = len(decode_context_lens) + len(prefill_chunks)
        attention_s = sum(decode_context_lens) * self._decode_ctx_s
        for prefix_len, num_tokens in prefill_chunks:
            pairs = num_tokens * prefix_len + num_tokens * (num_tokens + 1) // 2
            attention_s += max(pairs * self._pair_s, (prefix_len + num_tokens) * self._kv_token_s)
        compute_ms = self.linear_flops(tokens, sampled) * self._s_per_flop * 1000.0
        weight_read_ms = self._weight_read_s * 1000.0
        return IterationCost(
            linear_compute_ms=compute_ms,
            weight_read_ms=weight_read_ms,
            linear_ms=self.linear_ms(compute_ms, weight_read_ms),
            attention_ms=attention_s * 1000.0,
            overhead_ms=self.hardware.overhead_ms,
        )

    def profile(self, max_tokens: int = 4096, num_decodes: int = 32, context_len: int = 1024,
                max_num_seqs: int = 256, step: int = 64) -> Profile:
        """Predicted profile in /admin/profile's shape.

        decode_only: batches of 1..max_num_seqs decodes at `context_len`. mixed: `num_decodes` decodes plus
        one prefill chunk (mid-prompt, prefix `context_len`) filling the iteration up to `tokens`.
        """
        return predicted_profile(self, f"sim:{self.shape.name}@{self.hardware.name}", max_tokens, num_decodes,
                                 context_len, max_num_seqs, step)


def predicted_profile(model: IterationCostModel, device: str, max_tokens: int = 4096, num_decodes: int = 32,
                      context_len: int = 1024, max_num_seqs: int = 256, step: int = 64) -> Profile:
    decode_only = []
    batch = 1
    while batch <= max_num_seqs:
        decode_only.append(ProfilePoint(batch, batch, model.predict_ms([context_len] * batch, [])))
        batch *= 2
    if decode_only[-1].tokens != max_num_seqs:
        decode_only.append(ProfilePoint(max_num_seqs, max_num_seqs, model.predict_ms([context_len] * max_num_seqs, [])))
    mixed = []
    for tokens in range(step, max_tokens + 1, step):
        decodes = min(num_decodes, tokens // 2)
        chunk = [(context_len, tokens - decodes)]
        mixed.append(ProfilePoint(tokens, decodes, model.predict_ms([context_len] * decodes, chunk)))
    return Profile(device=device, decode_only=decode_only, mixed=mixed)


class ProfileCostModel:
    """Iteration time interpolated from a measured profile (a daemon's /admin/profile).

    A profile knows tokens per iteration, not context lengths: pure-decode batches follow the
    decode_only curve by batch size, any batch with prefill the mixed curve by total tokens.
    """

    def __init__(self, profile: Profile) -> None:
        if not profile.mixed:
            raise ValueError("a profile cost model needs at least one mixed point")
        self.profile = profile

    def predict_ms(self, decode_context_lens: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        num_decodes = len(decode_context_lens)
        if not prefill_chunks:
            # decode_ms_at falls back to the mixed curve at that many tokens without decode-only points.
            return self.profile.decode_ms_at(num_decodes) if num_decodes else 0.0
        return self.profile.iteration_ms_at(num_decodes + sum(n for _, n in prefill_chunks))
