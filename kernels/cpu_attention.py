"""The CPU attention backend: paged attention in a few large torch ops per layer.

A decode step of a small model on the CPU is bound by the number of ops as much as by arithmetic, so
everything that depends only on the iteration (which rows decode, the flattened KV gather index, the
masks) is built once in begin_iteration and every layer reuses it:

- the KV cache is head-major, [num_kv_heads, num_blocks, block_size, head_dim] per layer: a sequence's
  keys for one head are rows of one [num_slots, head_dim] matrix, so one index_select over a flattened
  slot index gathers every decode's keys as [kv_heads * decodes, longest, head_dim], ready for bmm;
- all decodes (one query token each) attend together: two bmm and a float32 softmax, the padding past
  each sequence's length masked by an additive mask (none when the lengths are equal);
- each prefill chunk attends through scaled_dot_product_attention with its bottom-right aligned causal
  mask (plain is_causal when the chunk is the whole sequence).

Scores, softmax and the GEMMs' accumulation are float32; bfloat16 operands stay bfloat16 (oneDNN's GEMMs
accumulate in float32), except in small decode batches, which are cast to float32 whole (cheaper there). kernels/torch_reference.py stays the reference this backend is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stallfree.kernels.attention import AttentionMetadata


# Decode batches of at most this many cached slots (decodes x longest length) attend in float32: below it
# the casts cost less than half-precision bmm's fixed overhead (docs/cpu.md has the timings).
FLOAT32_DECODE_MAX_SLOTS = 384


@dataclass
class _Prefill:
    first_row: int
    q_len: int
    gather: torch.Tensor  # [seq_len] flat slots of the sequence's cached tokens
    mask: torch.Tensor | None  # [q_len, seq_len] True where visible; None: plain causal (no cached prefix)


@dataclass
class CpuAttentionPlan:
    decode_rows: slice | torch.Tensor | None  # rows of the one-token sequences (a slice when contiguous)
    num_decodes: int
    decode_len: int  # the longest decode's KV length (the gather's width)
    decode_gather: torch.Tensor | None  # [num_decodes * decode_len] flat slots
    decode_mask: torch.Tensor | None  # [num_decodes, 1, decode_len] float32, 0 or -inf; None: no padding
    prefills: list[_Prefill]
    write_rows: torch.Tensor | None  # rows whose slot is valid, None: all
    write_slots: torch.Tensor


def plan_iteration(metadata: AttentionMetadata) -> CpuAttentionPlan:
    bs = metadata.block_size
    tables = metadata.block_tables
    device = tables.device
    decodes: list[int] = []
    decode_rows: list[int] = []
    prefills: list[_Prefill] = []
    row = 0
    for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
        if q_len == 1:
            decodes.append(i)
            decode_rows.append(row)
        elif q_len > 1:
            gather = _flat_slots(tables[i:i + 1], seq_len, bs).view(-1)
            mask = None
            if q_len != seq_len:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
                mask = torch.arange(seq_len, device=device).unsqueeze(0) <= q_pos
            prefills.append(_Prefill(row, q_len, gather, mask))
        row += q_len
    slots = metadata.slot_mapping
    write_rows = None
    if bool((slots < 0).any()):
        write_rows = (slots >= 0).nonzero().squeeze(1)
        slots = slots.index_select(0, write_rows)
    if not decodes:
        return CpuAttentionPlan(None, 0, 0, None, None, prefills, write_rows, slots)
    lens = [metadata.seq_lens_host[i] for i in decodes]
    longest = max(lens)
    n = len(decodes)
    if n == len(metadata.seq_lens_host):
        decode_tables = tables
    else:
        decode_tables = tables.index_select(0, torch.tensor(decodes, device=device))
    gather = _flat_slots(decode_tables, longest, bs).reshape(-1)
    mask = None
    if min(lens) != longest:
        visible = torch.arange(longest, device=device).unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1)
        mask = torch.zeros(n, 1, longest, device=device).masked_fill_(~visible.unsqueeze(1), float("-inf"))
    rows: slice | torch.Tensor = slice(decode_rows[0], decode_rows[0] + n)
    if decode_rows[-1] - decode_rows[0] != n - 1:
        rows = torch.tensor(decode_rows, device=device)
    return CpuAttentionPlan(rows, n, longest, gather, mask, prefills, write_rows, slots)


def _flat_slots(tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[seqs, length] cache slots of positions 0..length-1 through block tables [seqs, >= ceil(length / bs)]."""
    width = -(-length // block_size)
    offsets = torch.arange(block_size, device=tables.device, dtype=torch.int64)
    slots = tables[:, :width].long().unsqueeze(-1) * block_size + offsets
    return slots.view(tables.shape[0], -1)[:, :length]


def _decode_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, plan: CpuAttentionPlan,
                      scale: float) -> torch.Tensor:
    """q [n, H, D] -> [n, H, D]: every decode's query against its cached keys, all decodes at once."""
    n, num_heads, d = q.shape
    kv_heads = k_flat.shape[0]
    group = num_heads // kv_heads
    length = plan.decode_len
    k = k_flat.index_select(1, plan.decode_gather).view(kv_heads * n, length, d)
    v = v_flat.index_select(1, plan.decode_gather).view(kv_heads * n, length, d)
    qh = q.view(n, kv_heads, group, d).transpose(0, 1).reshape(kv_heads * n, group, d)
    if k.dtype != torch.float32 and n * length <= FLOAT32_DECODE_MAX_SLOTS:
        # Half-precision bmm has a fixed cost a call; tiny batches are cheaper cast to float32.
        k, v, qh = k.float(), v.float(), qh.float()
    scores = torch.bmm(qh, k.transpose(1, 2))
    if scores.dtype != torch.float32:
        scores = scores.float()
    if plan.decode_mask is None:
        scores = scores.mul_(scale)
    else:
        scores = torch.add(plan.decode_mask.repeat(kv_heads, 1, 1), scores, alpha=scale)
    probs = scores.softmax(dim=-1)
    out = torch.bmm(probs if probs.dtype == v.dtype else probs.to(v.dtype), v)
    out = out.view(kv_heads, n, group, d).transpose(0, 1).reshape(n, num_heads, d)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _prefill_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, p: _Prefill,
                       scale: float) -> torch.Tensor:
    """One chunk q [q_len, H, D] against its sequence's cached keys (the chunk's own included)."""
    k = k_flat.index_select(1, p.gather)[None]  # [1, KVH, seq_len, D]
    v = v_flat.index_select(1, p.gather)[None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=p.mask,
                                         is_causal=p.mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


class CpuAttentionBackend:
    name = "cpu"
    supports_cuda_graphs = False

    def __init__(self) -> None:
        self._plan: CpuAttentionPlan | None = None
        self._plan_for: AttentionMetadata | None = None

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Head-major: one [num_slots, head_dim] matrix per KV head."""
        return (num_kv_heads, num_blocks, block_size, head_dim)

    def begin_iteration(self, metadata: AttentionMetadata) -> None:
        self._plan = plan_iteration(metadata)
        self._plan_for = metadata

    def _plan_of(self, metadata: AttentionMetadata) -> CpuAttentionPlan:
        if self._plan_for is not metadata:
            self.begin_iteration(metadata)
        return self._plan

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        plan = self._plan if self._plan_for is not None and self._plan_for.slot_mapping is slot_mapping else None
        if plan is None:  # called outside an iteration (tests): index from the slot mapping itself
            keep = (slot_mapping >= 0).nonzero().squeeze(1)
            rows, slots = keep, slot_mapping.index_select(0, keep)
        else:
            rows, slots = plan.write_rows, plan.write_slots
        if rows is not None:
            key, value = key.index_select(0, rows), value.index_select(0, rows)
        kv_heads, d = k_cache.shape[0], k_cache.shape[-1]
        k_cache.view(kv_heads, -1, d).index_copy_(1, slots, key.transpose(0, 1).to(k_cache.dtype))
        v_cache.view(kv_heads, -1, d).index_copy_(1, slots, value.transpose(0, 1).to(v_cache.dtype))

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self._plan_of(metadata)
        kv_heads, d = k_cache.shape[0], k_cache.shape[-1]
        k_flat, v_flat = k_cache.view(kv_heads, -1, d), v_cache.view(kv_heads, -1, d)
        decoded = None
        if plan.decode_rows is not None:
            rows = plan.decode_rows
            q = query[rows] if isinstance(rows, slice) else query.index_select(0, rows)
            decoded = _decode_attention(q, k_flat, v_flat, plan, scale)
            if not plan.prefills:
                return decoded
        if decoded is None and len(plan.prefills) == 1 and plan.prefills[0].q_len == query.shape[0]:
            return _prefill_attention(query, k_flat, v_flat, plan.prefills[0], scale)
        out = torch.empty_like(query)
        if decoded is not None:
            if isinstance(plan.decode_rows, slice):
                out[plan.decode_rows] = decoded
            else:
                out.index_copy_(0, plan.decode_rows, decoded)
        for p in plan.prefills:
            out[p.first_row:p.first_row + p.q_len] = _prefill_attention(
                query[p.first_row:p.first_row + p.q_len], k_flat, v_flat, p, scale)
        return out
