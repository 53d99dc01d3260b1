"""Pure-torch paged attention: the CPU backend and the reference every kernel is tested against.

Decode rows (one query token each) are attended in one batched scaled_dot_product_attention over their
gathered block tables, masked past each sequence's length; prefill chunks go one sequence at a time
through scaled_dot_product_attention with the bottom-right aligned causal mask. Both run in `compute_dtype`
(float32 for half-precision inputs), so float64 inputs give a float64 reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stallfree.kernels.attention import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        # Slot s is row s of the cache seen as [num_blocks * block_size, heads, dim]: one index_put each.
        k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)
        return
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


@dataclass
class AttentionPlan:
    """How one iteration's rows split into batched decodes and per-sequence prefill chunks (host-built once)."""

    decode_rows: torch.Tensor | None  # [num_decodes] token rows of the one-token sequences
    decode_tables: torch.Tensor | None  # [num_decodes, width] their block tables, cut to the longest
    decode_visible: torch.Tensor | None  # [num_decodes, width * block_size] True where a key position exists
    prefills: list[tuple[int, int, int, int]]  # (seq index, first row, q_len, seq_len) of longer chunks


def plan_attention(metadata: AttentionMetadata, device: torch.device) -> AttentionPlan:
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    decode_lens: list[int] = []
    prefills: list[tuple[int, int, int, int]] = []
    row = 0
    for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
        if q_len == 1:
            decode_rows.append(row)
            decode_seqs.append(i)
            decode_lens.append(seq_len)
        elif q_len > 1:
            prefills.append((i, row, q_len, seq_len))
        row += q_len
    if not decode_rows:
        return AttentionPlan(None, None, None, prefills)
    bs = metadata.block_size
    width = -(-max(decode_lens) // bs)
    seqs = torch.tensor(decode_seqs, device=device)
    tables = metadata.block_tables[seqs, :width].long()
    lens = torch.tensor(decode_lens, device=device)
    visible = torch.arange(width * bs, device=device).unsqueeze(0) < lens.unsqueeze(1)
    return AttentionPlan(torch.tensor(decode_rows, device=device), tables, visible, prefills)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, compute_dtype: torch.dtype | None = None,
                    plan: AttentionPlan | None = None) -> torch.Tensor:
    """Per-sequence softmax(QK^T * scale + bottom-right causal mask) V with GQA, in `compute_dtype`."""
    compute_dtype = compute_dtype or (torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype)
    plan = plan or plan_attention(metadata, query.device)
    out = torch.empty_like(query)
    if plan.decode_rows is not None:
        out[plan.decode_rows] = _decode_attention(query[plan.decode_rows], k_cache, v_cache, plan, scale,
                                                  compute_dtype).to(query.dtype)
    for i, start, q_len, seq_len in plan.prefills:
        q = query[start:start + q_len].to(compute_dtype)
        k = gather_kv(k_cache, metadata.block_tables[i], seq_len).to(compute_dtype)
        v = gather_kv(v_cache, metadata.block_tables[i], seq_len).to(compute_dtype)
        out[start:start + q_len] = _chunk_attention(q, k, v, scale).to(query.dtype)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
                      scale: float, compute_dtype: torch.dtype) -> torch.Tensor:
    """q [n, H, D] -> [n, H, D]: every decode's one query against its whole cached sequence."""
    # [n, KVH, L, D] keys and values of each decode's blocks, positions past its length masked out.
    k = k_cache[plan.decode_tables].flatten(1, 2).transpose(1, 2).to(compute_dtype)
    v = v_cache[plan.decode_tables].flatten(1, 2).transpose(1, 2).to(compute_dtype)
    out = F.scaled_dot_product_attention(q.to(compute_dtype).unsqueeze(2), k, v,
                                         attn_mask=plan.decode_visible[:, None, None, :], scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's chunk: q [q_len, H, D] are the last q_len of the seq_len positions of k, v [s, KVH, D]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    # Bottom-right aligned causal mask: query j sits at absolute position seq_len - q_len + j.
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
    visible = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos
    # 4-D [batch, heads, tokens, dim] operands: the CPU dispatches those (not 3-D ones) to its flash kernel.
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


class TorchReferenceBackend:
    name = "torch"

    def __init__(self) -> None:
        self._plan: AttentionPlan | None = None
        self._plan_for: AttentionMetadata | None = None

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def begin_iteration(self, metadata: AttentionMetadata) -> None:
        # The decode/prefill split and the decodes' gathered block tables serve every layer.
        self._plan = plan_attention(metadata, metadata.block_tables.device)
        self._plan_for = metadata

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self._plan if self._plan_for is metadata else None
        return paged_attention(query, k_cache, v_cache, metadata, scale, plan=plan)
