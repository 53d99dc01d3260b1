"""The compiled forward's decode attention (models/cpu_decode_attention.h) with one sequence's keys split across
threads: the parts merged give what the whole task gives and what a float64 reference gives, for one kv head
(Gemma 3 270M's) and three (SmolLM2's), head sizes 64 and 256, a sliding window, a batch whose shorter sequence has
empty parts, and more parts than a sequence has keys. Each tier's kernel (AVX512-BF16; AVX2, forced on a bigger
CPU) is tested where the CPU has it; without a C++ compiler these tests skip."""
from __future__ import annotations

import pytest
import torch

from tier_kernels import KERNEL_TIERS, tier_kernels

BLOCK = 16


@pytest.fixture(scope="module", params=KERNEL_TIERS)
def ops(request):
    kernels = tier_kernels(request.param)
    assert str(kernels.attention_kernel()) == request.param
    return kernels


def _batch(lengths: list[int], heads: int, kv_heads: int, dim: int, window: int = 0, seed: int = 0):
    """One decode row a sequence of the given lengths -> q, caches, tables, lengths and the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 4
    k_cache = torch.randn(kv_heads, num_blocks, BLOCK, dim, generator=gen).bfloat16()
    v_cache = torch.randn(kv_heads, num_blocks, BLOCK, dim, generator=gen).bfloat16()
    q = (2 * torch.randn(len(lengths), heads, dim, generator=gen)).bfloat16()  # peaked softmaxes too
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // BLOCK) for n in lengths)
    tables, ref = [], torch.zeros(len(lengths), heads, dim, dtype=torch.float64)
    for i, n in enumerate(lengths):
        table = [blocks.pop() for _ in range(-(-n // BLOCK))]
        tables.append(table + [0] * (width - len(table)))
        slots = (torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)).view(-1)[:n]
        if window:
            slots = slots[-window:]
        k = k_cache.view(kv_heads, -1, dim)[:, slots].double().repeat_interleave(heads // kv_heads, 0)
        v = v_cache.view(kv_heads, -1, dim)[:, slots].double().repeat_interleave(heads // kv_heads, 0)
        scores = (q[i].double()[:, None, :] * k).sum(-1) * dim ** -0.5  # [heads, keys]
        ref[i] = (scores.softmax(-1)[:, :, None] * v).sum(1)
    return (q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lengths, dtype=torch.int32), ref)


@pytest.mark.parametrize("lengths,heads,kv_heads,dim,window", [
    ([1000], 4, 1, 256, 0),  # Gemma 3 270M's global layer: one kv head, four query heads
    ([700], 4, 1, 256, 512),  # its sliding layer: the window's keys split
    ([300], 9, 3, 64, 0),  # SmolLM2: three kv heads on two threads
    ([513, 40], 9, 3, 64, 0),  # the short sequence's later parts have no keys
    ([5], 4, 1, 256, 0),  # more parts than keys
])
@pytest.mark.parametrize("parts", [2, 3, 8])
def test_split_keys_merge_to_the_whole_tasks_answer(ops, lengths, heads, kv_heads, dim, window, parts):
    q, k_cache, v_cache, tables, lens, ref = _batch(lengths, heads, kv_heads, dim, window)
    scale = dim ** -0.5
    whole = ops.decode_attention(q, k_cache, v_cache, tables, lens, scale, window, 1).double()
    split = ops.decode_attention(q, k_cache, v_cache, tables, lens, scale, window, parts).double()
    whole_err = (whole - ref).abs().max().item()
    split_err = (split - ref).abs().max().item()
    # Both sum float32 products and round once to bfloat16: the split only rescales its parts' sums.
    assert split_err <= max(1.5 * whole_err, 2e-3), (split_err, whole_err)
    assert (split - whole).abs().max().item() < 0.02


@pytest.mark.parametrize("tasks,keys,threads,parts", [
    (1, 1000, 2, 2),  # one stream, one kv head: both threads
    (3, 1000, 2, 2),  # three kv heads on two threads: six even parts, not two heads against one
    (1, 1000, 4, 4),
    (16, 1000, 2, 1),  # a batch: its tasks spread already
    (1, 1000, 1, 1),  # one thread: nothing to share
    (1, 100, 2, 1),  # too few keys to pay for a second part
])
def test_the_forward_splits_few_tasks_with_enough_keys(ops, tasks, keys, threads, parts):
    assert ops.decode_parts(tasks, keys, threads) == parts


def test_the_forwards_own_choice_leaves_a_batch_whole(ops):
    """parts 0 (the forward's choice): a batch of sixteen sequences is not split, its answer the whole tasks' bit
    for bit."""
    scale = 256 ** -0.5
    q, k_cache, v_cache, tables, lens, _ = _batch([100 + 37 * i for i in range(16)], 4, 1, 256)
    assert torch.equal(ops.decode_attention(q, k_cache, v_cache, tables, lens, scale, 0, 0),
                       ops.decode_attention(q, k_cache, v_cache, tables, lens, scale, 0, 1))
