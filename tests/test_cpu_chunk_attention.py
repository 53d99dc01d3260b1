"""The compiled forward's prefill-chunk attention (models/cpu_chunk_attention.h) against ATen's
scaled_dot_product_attention (the Python path's call) and a float64 reference: chunks alone and over a cached
prefix, ragged lengths, grouped query heads, several chunks and decode rows in one batch, shuffled blocks.
Each tier's kernel (AVX512-BF16; AVX2, forced on a bigger CPU) is tested where the CPU has it; without a C++
compiler these tests skip."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stallfree.node_daemon.models import cpu_decode
from tier_kernels import KERNEL_TIERS, tier_kernels

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


@pytest.fixture(scope="module", params=KERNEL_TIERS)
def ops(request):
    """The chunk kernel of each tier this CPU has: AVX512-BF16, and AVX2 (forced on a bigger CPU, its own library)."""
    kernels = tier_kernels(request.param)
    assert kernels.set_chunk_kernel(True) and str(kernels.chunk_attention_kernel()) == request.param
    yield kernels
    kernels.set_chunk_kernel(cpu_decode.chunk_kernel_wanted())  # as the process chose


def _batch(seqs: list[tuple[int, int]], num_blocks: int = 200, seed: int = 0):
    """(query lengths, prefix lengths) per sequence -> q, caches, index tensors and the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(KV_HEADS, num_blocks, BLOCK, DIM, generator=gen).bfloat16()
    v_cache = torch.randn(KV_HEADS, num_blocks, BLOCK, DIM, generator=gen).bfloat16()
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    rows = sum(n for n, _ in seqs)
    q = torch.randn(rows, HEADS, DIM, generator=gen).bfloat16()
    width = max(-(-(n + p) // BLOCK) for n, p in seqs)
    tables, starts, lens, ref = [], [0], [], torch.zeros(rows, HEADS, DIM, dtype=torch.float64)
    for n, p in seqs:
        keys = n + p
        table = [blocks.pop() for _ in range(-(-keys // BLOCK))]
        tables.append(table + [0] * (width - len(table)))
        slots = (torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)).view(-1)[:keys]
        first = starts[-1]
        starts.append(first + n)
        lens.append(keys)
        if n == 1:
            continue  # decode rows: not the chunk attention's
        k = k_cache.view(KV_HEADS, -1, DIM)[:, slots].double().repeat_interleave(HEADS // KV_HEADS, 0)
        v = v_cache.view(KV_HEADS, -1, DIM)[:, slots].double().repeat_interleave(HEADS // KV_HEADS, 0)
        mask = torch.arange(keys)[None, :] <= torch.arange(p, keys)[:, None]
        out = F.scaled_dot_product_attention(q[first:first + n].double().transpose(0, 1), k, v, attn_mask=mask,
                                             scale=DIM ** -0.5)
        ref[first:first + n] = out.transpose(0, 1)
    index = (torch.tensor(starts, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
             torch.tensor(lens, dtype=torch.int32))
    return q, k_cache, v_cache, index, ref


@pytest.mark.parametrize("seqs", [
    [(37, 0)],  # a whole prompt, not a multiple of the key block
    [(256, 1000)],  # a chunk over a long cached prefix
    [(5, 11)],  # a short chunk over a short prefix: one query block, one key block
    [(1, 40), (70, 0), (1, 9), (33, 200)],  # decode rows (left to the decode loop) between two chunks
])
def test_chunk_kernel_follows_aten_attention_and_the_float64_reference(ops, seqs):
    q, k_cache, v_cache, (starts, tables, lens), ref = _batch(seqs)
    outs = {}
    for kernel in (False, True):
        ops.set_chunk_kernel(kernel)
        outs[kernel] = ops.chunk_attention(q, k_cache, v_cache, starts, tables, lens, DIM ** -0.5).double()
    chunk_rows = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i, (n, _) in enumerate(seqs)
                            if n > 1])
    aten_err = (outs[False][chunk_rows] - ref[chunk_rows]).abs().max().item()
    kernel_err = (outs[True][chunk_rows] - ref[chunk_rows]).abs().max().item()
    # Both round their inputs' products to float32 and the probabilities to bfloat16: errors of one size.
    assert kernel_err <= max(1.5 * aten_err, 2e-3), (kernel_err, aten_err)
    assert kernel_err < 0.02
    decode_rows = [int(starts[i]) for i, (n, _) in enumerate(seqs) if n == 1]
    assert all(not outs[True][r].any() for r in decode_rows)



def test_chunks_take_the_avx512_bf16_kernel_only_without_amx_unless_the_switch_says(monkeypatch):
    """On AMX (the top tier, not forced lower) ATen's attention, whose GEMMs oneDNN runs on AMX tiles, is the
    faster, and so it is over the float32 AVX2 form on Intel; the AVX512-BF16 kernel serves the other AVX512-BF16
    CPUs, the AVX2 kernel AMD's AVX2 tier; STALLFREE_CPU_CHUNK_KERNEL decides where it is set."""
    from stallfree.node_daemon.models import cpu_tier as tiers

    flags = "flags : avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni amx_bf16 amx_tile"
    assert tiers.resolve_tier(None, flags).amx
    assert not tiers.resolve_tier("avx2", flags).amx and not tiers.resolve_tier("avx512", flags).amx
    assert not tiers.resolve_tier(None, flags.replace(" amx_bf16 amx_tile", "")).amx
    monkeypatch.delenv(cpu_decode.CHUNK_KERNEL_SWITCH, raising=False)
    for amx in (True, False):
        monkeypatch.setattr(cpu_decode, "cpu_tier", lambda amx=amx: tiers.resolve_tier(
            None, flags if amx else flags.replace(" amx_bf16 amx_tile", "")))
        assert cpu_decode.chunk_kernel_wanted() is (not amx)
        monkeypatch.setattr(cpu_decode, "cpu_tier", lambda: tiers.resolve_tier("avx2", flags, "GenuineIntel"))
        assert cpu_decode.chunk_kernel_wanted() is False
        monkeypatch.setattr(cpu_decode, "cpu_tier", lambda: tiers.resolve_tier("avx2", flags, "AuthenticAMD"))
        assert cpu_decode.chunk_kernel_wanted() is True
        monkeypatch.setattr(cpu_decode, "cpu_tier", lambda: tiers.resolve_tier("avx2", flags, "GenuineIntel"))
        monkeypatch.setenv(cpu_decode.CHUNK_KERNEL_SWITCH, "1")
        assert cpu_decode.chunk_kernel_wanted() is True
        monkeypatch.setenv(cpu_decode.CHUNK_KERNEL_SWITCH, "0")
        assert cpu_decode.chunk_kernel_wanted() is False
        monkeypatch.delenv(cpu_decode.CHUNK_KERNEL_SWITCH)
