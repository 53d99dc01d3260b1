"""flashinfer's paged-KV arrays (indptr, indices, last page lengths) checked against the block tables."""
from __future__ import annotations

import random

import pytest
import torch

from stallfree.kernels.attention import AttentionMetadata
from stallfree.kernels.flashinfer_index import build_paged_kv_indices
from stallfree.kernels.torch_reference import gather_kv


def random_metadata(rng: random.Random, page_size: int, num_seqs: int) -> AttentionMetadata:
    specs = []
    for _ in range(num_seqs):
        kind = rng.choice(["decode", "prefill", "chunk", "page_edge"])
        if kind == "decode":
            seq_len = rng.randint(1, 200)
            specs.append((1, seq_len))
        elif kind == "prefill":
            q = rng.randint(1, 90)
            specs.append((q, q))
        elif kind == "chunk":
            q = rng.randint(2, 40)
            specs.append((q, q + rng.randint(1, 120)))
        else:  # lengths that end exactly on a page boundary
            seq_len = page_size * rng.randint(1, 6)
            specs.append((1, seq_len))
    pages = [-(-s // page_size) for _, s in specs]
    width = max(pages) + rng.randint(0, 3)
    pool = list(range(sum(pages) + 7))
    rng.shuffle(pool)
    tables = torch.zeros((num_seqs, width), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        tables[i, :n] = torch.tensor(pool[used:used + n])
        used += n
    q_lens = [q for q, _ in specs]
    seq_lens = [s for _, s in specs]
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return AttentionMetadata(qsl, torch.tensor(seq_lens, dtype=torch.int32), tables,
                             torch.zeros(sum(q_lens), dtype=torch.int64), max(q_lens), max(seq_lens),
                             q_lens, seq_lens, page_size)


@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_indices_equal_the_used_block_table_prefix(page_size):
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    for _ in range(20):
        md = random_metadata(rng, page_size, rng.randint(1, 12))
        idx = build_paged_kv_indices(md)
        assert idx.qo_indptr.dtype == idx.kv_indptr.dtype == idx.kv_indices.dtype == torch.int32
        assert torch.equal(idx.qo_indptr, md.query_start_loc), f"seed {seed}"
        for i, seq_len in enumerate(md.seq_lens_host):
            lo, hi = int(idx.kv_indptr[i]), int(idx.kv_indptr[i + 1])
            n = -(-seq_len // page_size)
            assert hi - lo == n, f"seed {seed}"
            assert torch.equal(idx.kv_indices[lo:hi], md.block_tables[i, :n]), f"seed {seed}"
            last = int(idx.kv_last_page_len[i])
            assert 1 <= last <= page_size and (n - 1) * page_size + last == seq_len, f"seed {seed}"


def test_pages_address_the_same_kv_as_the_reference_gather():
    """Reading the cache through (kv_indices, last page length) yields exactly the reference's KV rows."""
    rng = random.Random(random.SystemRandom().randrange(2**31))
    md = random_metadata(rng, 16, 6)
    idx = build_paged_kv_indices(md)
    num_blocks = int(md.block_tables.max()) + 1
    cache = torch.randn(num_blocks, 16, 2, 8)
    for i, seq_len in enumerate(md.seq_lens_host):
        pages = idx.kv_indices[idx.kv_indptr[i]:idx.kv_indptr[i + 1]].long()
        rows = cache[pages].flatten(0, 1)
        rows = rows[:(len(pages) - 1) * 16 + int(idx.kv_last_page_len[i])]
        assert torch.equal(rows, gather_kv(cache, md.block_tables[i], seq_len))


def test_empty_sequence_gets_no_pages():
    tables = torch.tensor([[5, 6], [0, 0], [9, 0]], dtype=torch.int32)
    md = AttentionMetadata(torch.tensor([0, 1, 1, 2], dtype=torch.int32), torch.tensor([20, 0, 3], dtype=torch.int32),
                           tables, torch.zeros(2, dtype=torch.int64), 1, 20, [1, 0, 1], [20, 0, 3], 16)
    idx = build_paged_kv_indices(md)
    assert idx.kv_indptr.tolist() == [0, 2, 2, 3]
    assert idx.kv_indices.tolist() == [5, 6, 9]
    assert idx.kv_last_page_len.tolist() == [4, 0, 3]


def test_inconsistent_metadata_is_rejected():
    md = AttentionMetadata(torch.tensor([0, 5], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                           torch.zeros((1, 1), dtype=torch.int32), torch.zeros(5, dtype=torch.int64),
                           5, 3, [5], [3], 16)
    with pytest.raises(ValueError, match="seq_len"):
        build_paged_kv_indices(md)
    md = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
                           torch.zeros((1, 2), dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                           1, 40, [1], [40], 16)
    with pytest.raises(ValueError, match="pages"):
        build_paged_kv_indices(md)


def test_flashinfer_reads_our_lengths_back():
    """flashinfer's own helper turns our indptr and last page lengths back into the sequence lengths."""
    page = pytest.importorskip("flashinfer.page")
    rng = random.Random(random.SystemRandom().randrange(2**31))
    md = random_metadata(rng, 16, 9)
    idx = build_paged_kv_indices(md)
    assert page.get_seq_lens(idx.kv_indptr, idx.kv_last_page_len, 16).tolist() == md.seq_lens_host
