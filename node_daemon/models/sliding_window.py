"""Attention of a sliding-window layer (Gemma 3) over the paged KV cache: each query sees its sequence's keys at
positions p - window + 1 .. p (its own included), as Hugging Face's sliding mask and llama.cpp's standard SWA do.

The backends attend causally over the whole sequence; a layer calls this only when some sequence is longer than
the window (within it both are the same). Each sequence's window of keys is gathered from its block table and
attended with scaled_dot_product_attention under a banded mask, prefill chunks over a cached prefix included. The
cache keeps every block: keys past the window are never read, never freed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stallfree.kernels.attention import AttentionBackend, AttentionMetadata


def is_head_major(attn: AttentionBackend) -> bool:
    """Whether the backend's caches are [kv_heads, num_blocks, block_size, head_dim] (the CPU backend's) rather than
    the default [num_blocks, block_size, kv_heads, head_dim]."""
    cache_shape = getattr(attn, "cache_shape", None)
    return cache_shape is not None and tuple(cache_shape(5, 7, 3, 2)) == (3, 5, 7, 2)


def windowed_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       metadata: AttentionMetadata, scale: float, window: int,
                       attn: AttentionBackend) -> torch.Tensor:
    """query [num_tokens, heads, head_dim] -> output of the same shape; this step's keys already written."""
    head_major = is_head_major(attn)
    kv_heads, dim = (k_cache.shape[0], k_cache.shape[-1]) if head_major else (k_cache.shape[-2], k_cache.shape[-1])
    k_flat, v_flat = (k_cache.view(kv_heads, -1, dim), v_cache.view(kv_heads, -1, dim)) if head_major \
        else (k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim))
    block_size, device = metadata.block_size, query.device
    out = torch.empty_like(query)
    first = 0
    for seq, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
        if q_len == 0:
            continue
        # Query j sits at position seq_len - q_len + j; the first query's window starts window - 1 keys back.
        start = max(0, seq_len - q_len - window + 1)
        key_pos = torch.arange(start, seq_len, device=device)
        table = metadata.block_tables[seq].long()
        slots = table[key_pos // block_size] * block_size + key_pos % block_size
        if head_major:
            k, v = k_flat.index_select(1, slots), v_flat.index_select(1, slots)  # [kv_heads, keys, dim]
        else:
            k, v = k_flat.index_select(0, slots).transpose(0, 1), v_flat.index_select(0, slots).transpose(0, 1)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        offset = query_pos[:, None] - key_pos[None, :]
        visible = (offset >= 0) & (offset < window)  # [q_len, keys]
        q = query[first:first + q_len].transpose(0, 1)  # [heads, q_len, dim]
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype),
                                           attn_mask=visible, scale=scale, enable_gqa=True)
        out[first:first + q_len] = o[0].transpose(0, 1)
        first += q_len
    return out
