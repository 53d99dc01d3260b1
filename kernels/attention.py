"""The attention interface the model runner calls, and how a backend is chosen.

One iteration is one ragged batch: sequences laid end to end (no padding), each contributing
`q_len` query tokens (1 for a decode, a chunk for a prefill) and attending to its first `seq_len`
cached tokens, the new ones included, through its block table. Masking is causal and bottom-right
aligned: query i of a sequence sees keys 0 .. seq_len - q_len + i. That makes a chunk over a cached
prefix exact.

KV cache layout per layer (flashinfer's NHD, vLLM's flash layout):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
Slot s lives at block s // block_size, offset s % block_size. A backend may choose another layout
through a `cache_shape(num_blocks, block_size, num_kv_heads, head_dim)` method (the CPU backend is
head-major); the model runner allocates what it asks for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Index tensors of one iteration, built once by the model runner and shared by every layer.

    Device tensors (int32 unless noted) plus host-side Python lists of the same figures, so that
    backends that plan on the host (flashinfer) need no device-to-host copy.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1], prefix sums of q_len
    seq_lens: torch.Tensor  # [num_seqs], KV length after this step's tokens are written
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token (-1: skip)
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int]
    seq_lens_host: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_host))


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store this step's key/value [num_tokens, num_kv_heads, head_dim] at their slots."""

    def begin_iteration(self, metadata: AttentionMetadata) -> None:
        """Per-iteration planning (index construction, workspace); called once before the layers run."""

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim] -> output of the same shape."""


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """`auto`: flashinfer, then Triton on CUDA; the CPU backend (kernels/cpu_attention.py) on the CPU.
    Explicit names are honoured."""
    from stallfree.kernels import selection

    return selection.select_backend(name, torch.device(device))
