"""Pure-torch paged attention: the CPU backend and the reference every kernel is tested against."""
from __future__ import annotations

import torch

from stallfree.kernels.attention import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-sequence softmax(QK^T * scale + bottom-right causal mask) V with GQA, in `compute_dtype`."""
    compute_dtype = compute_dtype or (torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype)
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
        if q_len == 0:
            continue
        q = query[start:start + q_len].to(compute_dtype)  # [q, H, D]
        k = gather_kv(k_cache, metadata.block_tables[i], seq_len).to(compute_dtype)  # [s, KVH, D]
        v = gather_kv(v_cache, metadata.block_tables[i], seq_len).to(compute_dtype)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        # Bottom-right aligned causal mask: query j sits at absolute position seq_len - q_len + j.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        start += q_len
    return out


class TorchReferenceBackend:
    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def begin_iteration(self, metadata: AttentionMetadata) -> None:
        pass

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(query, k_cache, v_cache, metadata, scale)
