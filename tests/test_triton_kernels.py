"""Triton KV write and paged attention under TRITON_INTERPRET=1 against the torch reference in float64.

Fresh random inputs every run (the seed is in each failure message), outputs poisoned with NaN first so
an unwritten element fails, and the whole cache random so a read through a wrong block shows.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated: they then run on numpy

import importlib
import random
import sys

# Another test module may have imported the kernels compiled for a GPU first: decorate them again.
for _name in ("stallfree.kernels.triton_kv_write", "stallfree.kernels.triton_attention"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])

import pytest
import torch

from stallfree.kernels import torch_reference
from stallfree.kernels.attention import AttentionMetadata
from stallfree.kernels.triton_attention import TritonBackend, choose_num_splits, paged_attention
from stallfree.kernels.triton_kv_write import write_kv

# bf16 under the interpreter: bf16 stored, fp32 computed, P and the output rounded to bf16 by truncation (the
# interpreter's fp32 -> bf16 cast); measured worst per-token error about 7e-3, the GPU check's gate is 1e-2.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def make_batch(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, gen: torch.Generator, spare_blocks: int = 3):
    """specs: (q_len, seq_len) per sequence. Blocks are handed out in a random order, as a real pool would."""
    pages = [(seq_len + block_size - 1) // block_size for _, seq_len in specs]
    num_blocks = sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    max_pages = max(pages) + 1  # one padding column: the kernel must not read past a sequence's pages
    block_tables = torch.zeros((len(specs), max_pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        block_tables[i, :n] = order[used:used + n]
        used += n
    q_lens = [q for q, _ in specs]
    seq_lens = [s for _, s in specs]
    query_start_loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    num_tokens = sum(q_lens)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_host=q_lens, seq_lens_host=seq_lens, block_size=block_size,
    )
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn((num_tokens, num_heads, head_dim), generator=gen).to(dtype)
    return query, k_cache, v_cache, metadata


def reference(query, k_cache, v_cache, metadata, scale) -> torch.Tensor:
    return torch_reference.paged_attention(query.double(), k_cache.double(), v_cache.double(), metadata, scale,
                                           compute_dtype=torch.float64)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    assert not torch.isnan(out).any(), f"unwritten (NaN) outputs remain; seed {seed}"
    err = (out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    worst = err.max().item()
    assert worst < TOLERANCE[dtype], f"worst per-token relative error {worst:.2e}; seed {seed}"


DECODES = [(1, 1), (1, 17), (1, 33), (1, 50), (1, 5)]
PREFILLS = [(7, 7), (19, 19), (33, 33)]
CHUNKED = [(9, 40), (37, 53), (5, 70)]  # chunks over an existing prefix
MIXED = [(1, 45), (1, 3), (1, 64), (23, 61), (13, 13), (1, 30)]
CASES = {"decodes": DECODES, "prefills": PREFILLS, "chunked": CHUNKED, "mixed": MIXED}

# Every batch kind, GQA ratio, page size and dtype appears; the full cross product would be too slow.
PARAMS = [
    ("decodes", 1, 16, torch.float32), ("decodes", 4, 32, torch.float16), ("decodes", 8, 16, torch.float16),
    ("prefills", 1, 32, torch.float16), ("prefills", 4, 16, torch.float32), ("prefills", 8, 32, torch.float32),
    ("chunked", 1, 16, torch.float16), ("chunked", 4, 32, torch.float32), ("chunked", 8, 16, torch.float16),
    ("mixed", 1, 32, torch.float32), ("mixed", 4, 16, torch.float16), ("mixed", 8, 32, torch.float16),
    # bf16, the dtype the GPU runs: every batch kind
    ("decodes", 4, 16, torch.bfloat16), ("prefills", 8, 16, torch.bfloat16), ("chunked", 4, 32, torch.bfloat16),
    ("mixed", 8, 16, torch.bfloat16), ("mixed", 1, 32, torch.bfloat16),
]


@pytest.mark.parametrize("kind,group,block_size,dtype", PARAMS)
def test_paged_attention_matches_reference(kind, group, block_size, dtype):
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = 2, 32
    query, k_cache, v_cache, metadata = make_batch(CASES[kind], num_kv_heads * group, num_kv_heads, head_dim,
                                                   block_size, dtype, gen)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    paged_attention(query, k_cache, v_cache, metadata, scale, out=out, num_splits=1)
    assert_close(out, reference(query, k_cache, v_cache, metadata, scale), dtype, seed)


@pytest.mark.parametrize("group,dtype", [(4, torch.float32), (1, torch.float16), (4, torch.bfloat16)])
def test_split_kv_decode_matches_reference(group, dtype):
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    # Lengths shorter than one split's share leave empty splits, which the merge must weigh by zero.
    specs = [(1, 150), (1, 7), (1, 97)]
    query, k_cache, v_cache, metadata = make_batch(specs, 2 * group, 2, 32, 16, dtype, gen)
    out = torch.full_like(query, float("nan"))
    paged_attention(query, k_cache, v_cache, metadata, 0.2, out=out, num_splits=4)
    assert_close(out, reference(query, k_cache, v_cache, metadata, 0.2), dtype, seed)


def test_odd_group_and_head_dim():
    """Qwen2-0.5B packs 7 query heads per KV head; head_dim 48 is not a power of two."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    query, k_cache, v_cache, metadata = make_batch([(1, 20), (11, 29), (6, 6)], 14, 2, 48, 16, torch.float32, gen)
    out = torch.full_like(query, float("nan"))
    TritonBackend().forward(query, k_cache, v_cache, metadata, 0.15)  # default tile and split choice runs
    paged_attention(query, k_cache, v_cache, metadata, 0.15, out=out)
    assert_close(out, reference(query, k_cache, v_cache, metadata, 0.15), torch.float32, seed)


def test_padding_sequences_leave_real_rows_exact():
    """CUDA-graph padding: extra one-token sequences over block 0 must not disturb the real rows."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    query, k_cache, v_cache, metadata = make_batch([(1, 21), (1, 40), (1, 1), (1, 1)], 8, 2, 32, 16,
                                                   torch.float32, gen)
    metadata.block_tables[2:] = 0
    out = torch.full_like(query, float("nan"))
    paged_attention(query, k_cache, v_cache, metadata, 0.2, out=out, num_splits=1)
    assert_close(out, reference(query, k_cache, v_cache, metadata, 0.2), torch.float32, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_stores_slots_and_skips_empty(dtype):
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 3, 24, 21
    # K and V as strided views of one fused projection, as a model's QKV split produces them.
    qkv = torch.randn((num_tokens, 5, num_kv_heads, head_dim), generator=gen).to(dtype)
    key, value = qkv[:, 1], qkv[:, 3]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:5]] = -1
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slots)
    torch_reference.write_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache.isnan(), k_ref.isnan()), f"written slot set differs; seed {seed}"
    assert torch.equal(k_cache.nan_to_num(0), k_ref.nan_to_num(0)), f"seed {seed}"
    assert torch.equal(v_cache.nan_to_num(0), v_ref.nan_to_num(0)), f"seed {seed}"
    assert int((~k_cache[..., 0, 0].isnan()).sum()) == num_tokens - 5


def test_write_then_attend_roundtrip():
    """A prefill written by the Triton KV kernel then attended by the Triton kernel equals the reference."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    query, k_cache, v_cache, metadata = make_batch([(12, 12), (1, 9)], 4, 1, 16, 16, torch.float32, gen)
    key = torch.randn((13, 1, 16), generator=gen)
    value = torch.randn((13, 1, 16), generator=gen)
    # Slots of the new tokens: sequence 0's twelve prefill tokens, then sequence 1's last token.
    bt = metadata.block_tables
    slots = [int(bt[0, p // 16]) * 16 + p % 16 for p in range(12)] + [int(bt[1, 0]) * 16 + 8]
    metadata.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    backend = TritonBackend(num_splits=1)
    backend.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
    out = backend.forward(query, k_cache, v_cache, metadata, 0.25)
    assert torch.equal(k_cache[bt[0, 0].long(), :12], key[:12])
    assert_close(out, reference(query, k_cache, v_cache, metadata, 0.25), torch.float32, seed)


def test_split_choice_is_decode_only_and_power_of_two():
    assert choose_num_splits(7, 1, 8, 8192, 132, 64) == 1  # a prefill chunk never splits
    assert choose_num_splits(1, 256, 8, 8192, 132, 64) == 1  # enough programs already
    n = choose_num_splits(1, 1, 8, 8192, 132, 64)
    assert n > 1 and n & (n - 1) == 0 and n <= 16
    assert choose_num_splits(1, 1, 8, 100, 132, 64) == 1  # too short to be worth a merge


def test_bad_head_ratio_is_rejected():
    q = torch.zeros((1, 6, 16))
    cache = torch.zeros((1, 16, 4, 16))
    md = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                           torch.zeros((1, 1), dtype=torch.int32), torch.tensor([0]), 1, 1, [1], [1], 16)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q, cache, cache, md, 1.0)
