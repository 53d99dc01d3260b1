"""Triton kernel that stores this step's key/value rows into the paged KV cache.

One program per new token copies its [num_kv_heads, head_dim] key and value rows to slot
`slot_mapping[t]` (block slot // block_size, offset slot % block_size). Slot -1 marks a token whose
KV must not be written (CUDA-graph padding, or tokens whose KV is already cached): the program exits.
The launch never reads anything back to the host, so it is safe inside a captured CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    tok = token.to(tl.int64)
    k = tl.load(key_ptr + tok * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + heads * stride_kc_head + dims
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + heads * stride_vc_head + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] (last dim contiguous; views of a fused QKV are fine)
    -> k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping [num_tokens]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv needs the head_dim axis of key, value and both caches to be contiguous")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
