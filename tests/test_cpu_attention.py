"""The CPU attention backend against the float64 torch reference: decodes (equal and unequal lengths, in the
float32 small-batch path and the half-precision bmm path), prefills, chunks over a cached prefix and mixed
batches, in float32 and bfloat16, with the KV written through the backend itself."""
from __future__ import annotations

import pytest
import torch

from stallfree.kernels import cpu_attention, torch_reference
from stallfree.kernels.attention import AttentionMetadata
from stallfree.kernels.cpu_attention import CpuAttentionBackend

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CASES = {
    "short decodes": [(1, 17), (1, 5), (1, 33)],
    "long decodes": [(1, 300), (1, 211), (1, 300)],
    "equal decodes": [(1, 40), (1, 40)],
    "prefill": [(29, 29)],
    "chunk over prefix": [(9, 40), (37, 53)],
    "mixed": [(1, 45), (23, 61), (1, 3), (13, 13), (1, 64)],
}


def _batch(specs, num_kv_heads, group, head_dim, block_size, dtype, gen):
    pages = [-(-seq_len // block_size) for _, seq_len in specs]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros((len(specs), max(pages) + 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        tables[i, :n] = order[used:used + n]
        used += n
    q_lens, seq_lens = [q for q, _ in specs], [s for _, s in specs]
    # This step's tokens are the last q_len positions of each sequence.
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size
             for i, (q, s) in enumerate(specs) for p in range(s - q, s)]
    starts = torch.zeros(len(specs) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    metadata = AttentionMetadata(starts, torch.tensor(seq_lens, dtype=torch.int32), tables,
                                 torch.tensor(slots, dtype=torch.int64), max(q_lens), max(seq_lens), q_lens, seq_lens,
                                 block_size)
    nhd = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(nhd, generator=gen).to(dtype), torch.randn(nhd, generator=gen).to(dtype)
    tokens = sum(q_lens)
    query = torch.randn((tokens, num_kv_heads * group, head_dim), generator=gen).to(dtype)
    key = torch.randn((tokens, num_kv_heads, head_dim), generator=gen).to(dtype)
    value = torch.randn((tokens, num_kv_heads, head_dim), generator=gen).to(dtype)
    return query, key, value, k_cache, v_cache, metadata


@pytest.mark.parametrize("float32_slots", [0, 10**9], ids=["half-precision bmm", "float32 decodes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_backend_matches_the_reference(case, dtype, float32_slots, monkeypatch):
    monkeypatch.setattr(cpu_attention, "FLOAT32_DECODE_MAX_SLOTS", float32_slots)
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    num_kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    query, key, value, k_nhd, v_nhd, metadata = _batch(CASES[case], num_kv_heads, group, head_dim, block_size,
                                                       dtype, gen)
    scale = head_dim ** -0.5
    # The reference: NHD caches in float64, the step's keys written first.
    k_ref, v_ref = k_nhd.double(), v_nhd.double()
    torch_reference.write_kv(key.double(), value.double(), k_ref, v_ref, metadata.slot_mapping)
    ref = torch_reference.paged_attention(query.double(), k_ref, v_ref, metadata, scale, compute_dtype=torch.float64)

    backend = CpuAttentionBackend()
    k_cache = k_nhd.permute(2, 0, 1, 3).contiguous()  # the backend's head-major layout
    v_cache = v_nhd.permute(2, 0, 1, 3).contiguous()
    assert k_cache.shape == backend.cache_shape(k_nhd.shape[0], block_size, num_kv_heads, head_dim)
    backend.begin_iteration(metadata)
    backend.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
    out = backend.forward(query, k_cache, v_cache, metadata, scale)

    assert out.dtype == dtype and out.shape == query.shape
    err = (out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    assert err.max().item() < TOLERANCE[dtype], f"worst per-token relative error {err.max().item():.2e}"
