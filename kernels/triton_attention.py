"""One Triton paged-attention kernel for the whole mixed batch (decodes and prefill chunks in one launch).

Work decomposition. The ragged batch is cut into query blocks of BLOCK_Q tokens per sequence; one
program takes one query block of one sequence for one KV head. The GROUP query heads that share that
KV head are packed into the tile's rows (row = token * GROUP + head-in-group), so a one-token decode
still gives the matrix units GROUP rows, and every K/V tile read from HBM serves all of them.

Grid without host synchronisation. Sequence s owns the program ids
    query_start_loc[s] // BLOCK_Q + s  ...  query_start_loc[s + 1] // BLOCK_Q + s
(at least ceil(q_len / BLOCK_Q) of them, at most one spare), so num_tokens // BLOCK_Q + num_seqs
programs cover any batch. Both figures are host-known shapes; each program finds its sequence by a
binary search over query_start_loc on the device. Spare programs exit at once.

Masking is bottom-right causal: query t of a sequence sits at absolute position seq_len - q_len + t
and sees keys 0 .. that position, so a chunk over a cached prefix is exact. K/V are read tile by tile
(BLOCK_N positions) through the block table; the softmax is online, in fp32, base 2.

Split-KV (flash-decoding): for decode-only batches too small to fill the GPU, each (sequence, KV head)
is split into NUM_SPLITS ranges of its KV whose partial outputs and log-sum-exps a second kernel
merges. The split count is a launch constant; each program sizes its range from the sequence's own
length on the device, so a captured CUDA graph stays valid as sequences grow.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stallfree.kernels import triton_kv_write
from stallfree.kernels.attention import AttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Largest s with query_start_loc[s] // BLOCK_Q + s <= q_block (the sequence that owns this program)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    num_seqs, qk_scale_log2,
    stride_q_tok, stride_q_head,
    stride_o_tok, stride_o_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_bt_seq,
    stride_po_tok, stride_po_head, stride_po_split,
    stride_pl_tok, stride_pl_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IEEE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // GROUP  # token index within the sequence's chunk
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_FP32:  # the interpreter only: its bf16 arithmetic works on the raw bits (kernels/README.md)
        q = q.to(tl.float32)
    q_pos = context_len + tok

    # Keys this tile can see: up to the last valid query's position (bottom-right causal).
    kv_end = context_len + tl.minimum(first_tok + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_valid = pos < kv_end
        block = tl.load(block_table + pos // PAGE_SIZE, mask=pos_valid, other=0).to(tl.int64)
        in_page = pos % PAGE_SIZE
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kc_block + in_page[:, None] * stride_kc_slot
                    + kv_head * stride_kc_head + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key in this split's first tiles: keep exp2 away from (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vc_block + in_page[:, None] * stride_vc_slot
                    + kv_head * stride_vc_head + dims[None, :], mask=kv_mask, other=0.0)
        p_dot = p.to(v.dtype)  # P rounded to the cache's dtype, as the matrix units take it
        if DOT_FP32:
            p_dot = p_dot.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p_dot, v)
        m_i = m_new

    out_mask = row_valid[:, None] & dim_valid[None, :]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(partial_out_ptr + q_rows[:, None] * stride_po_tok + head[:, None] * stride_po_head
                 + split * stride_po_split + dims[None, :], out, mask=out_mask)
        tl.store(partial_lse_ptr + q_rows * stride_pl_tok + head * stride_pl_head + split, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    stride_po_tok, stride_po_head, stride_po_split,
    stride_pl_tok, stride_pl_head,
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    lse = tl.load(partial_lse_ptr + tok * stride_pl_tok + head * stride_pl_head + splits)
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - lse_max)  # empty splits carry -inf: weight 0
    parts = tl.load(partial_out_ptr + tok * stride_po_tok + head * stride_po_head
                    + splits[:, None] * stride_po_split + dims[None, :], mask=dim_valid[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_valid)


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the attention kernel. Defaults below were checked on sm_90 by e2e/gpu/compile_sm90.py
    (no spills, wgmma for 64/128-row tiles, cp.async pipelining); e2e/gpu/gpu_check.py sweeps alternatives."""

    block_m: int  # tile rows: BLOCK_Q tokens x GROUP packed query heads
    block_n: int  # key positions per KV tile
    num_warps: int = 4
    num_stages: int = 2


def choose_config(max_query_len: int, group: int, on_gpu: bool) -> KernelConfig:
    """The launch shape from host-known figures only (never a device read)."""
    rows = max(16, triton.next_power_of_2(group))
    if max_query_len * group <= 16:
        return KernelConfig(rows, 64 if on_gpu else 32)  # decode-only: one token's heads fill the rows
    if not on_gpu:
        return KernelConfig(max(32, rows), 32)  # the interpreter: small tiles, few programs
    if max_query_len * group >= 512:
        return KernelConfig(max(128, rows), 64, num_warps=8)  # prefill chunks: two warpgroups of wgmma
    return KernelConfig(max(64, rows), 64, num_warps=4)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(max_query_len: int, num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int, block_n: int) -> int:
    """Split-KV only for decode-only batches whose programs cannot fill the GPU and whose KV is long."""
    if max_query_len != 1:
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= num_sms:
        return 1
    by_occupancy = math.ceil(2 * num_sms / programs)
    by_length = max_seq_len // (4 * block_n)  # at least four tiles per split
    n = min(by_occupancy, by_length, 16)
    return 1 if n < 2 else 1 << (n.bit_length() - 1)  # a power of two: the merge kernel's arange


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                    num_splits: int | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] over k/v_cache [num_blocks, block_size, num_kv_heads, head_dim].

    `num_splits` None picks split-KV from the batch shape; tests and CUDA-graph capture may fix it.
    `config` None picks the launch shape from the batch shape; benchmarks sweep it.
    Rows of tokens that belong to no sequence are left as they were in `out`.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs the head_dim axis of query and caches to be contiguous")
    if out is None:
        out = torch.empty_like(query)
    num_seqs = metadata.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    on_gpu = query.is_cuda
    config = config or choose_config(metadata.max_query_len, group, on_gpu)
    if config.block_m < group:
        raise ValueError(f"block_m {config.block_m} cannot hold the {group} query heads of one KV head")
    block_q = config.block_m // group
    if num_splits is None:
        num_sms = _num_sms(query.device.index or 0) if on_gpu else 1
        num_splits = choose_num_splits(metadata.max_query_len, num_seqs, num_kv_heads, metadata.max_seq_len,
                                       num_sms, config.block_n)
    if num_splits > 1:
        if num_splits & (num_splits - 1):
            raise ValueError(f"num_splits must be a power of two, got {num_splits}")
        partial_out = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32,
                                  device=query.device)
        partial_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused by the kernel; any tensor satisfies the signature
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    # bf16 on the CPU is the Triton interpreter, whose bf16 dots are wrong: there, bf16 is stored and fp32 computed.
    dot_fp32 = not on_gpu and query.dtype == torch.bfloat16
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, partial_out, partial_lse,
        metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
        num_seqs, scale * LOG2E,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        metadata.block_tables.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2) if num_splits > 1 else 0,
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_Q=block_q, BLOCK_M=config.block_m, BLOCK_N=config.block_n, PAGE_SIZE=k_cache.shape[1],
        NUM_SPLITS=num_splits, IEEE_DOT=query.dtype == torch.float32 or dot_fp32, DOT_FP32=dot_fp32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            partial_out, partial_lse, out,
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits,
        )
    return out


class TritonBackend:
    """AttentionBackend over the two Triton kernels; every index it needs is already in the metadata."""

    name = "triton"
    supports_cuda_graphs = True  # no host-side state per step: a captured launch stays valid

    def __init__(self, num_splits: int | None = None) -> None:
        self.num_splits = num_splits  # None: chosen per batch; CUDA-graph capture may pin it

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        triton_kv_write.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def begin_iteration(self, metadata: AttentionMetadata) -> None:
        pass  # nothing to plan: the kernel reads query_start_loc, seq_lens and block tables itself

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(query, k_cache, v_cache, metadata, scale, num_splits=self.num_splits)
