"""flashinfer's paged-KV index arrays built from one iteration's AttentionMetadata, in plain torch.

flashinfer describes a batch by CSR-style arrays instead of a padded block table:
    qo_indptr        [num_seqs + 1]  prefix sums of query lengths (our query_start_loc)
    kv_indptr        [num_seqs + 1]  prefix sums of pages per sequence, ceil(seq_len / page_size)
    kv_indices       [kv_indptr[-1]] the pages themselves, sequence after sequence (the used block-table prefix)
    kv_last_page_len [num_seqs]      tokens in each sequence's last page, 1..page_size (0 for an empty sequence)
so that seq_len = (pages - 1) * page_size + last_page_len.

The three small arrays are built on the host from the metadata's host lists (flashinfer's plan() reads
them on the host anyway). kv_indices is gathered on the device from the block tables already there:
one copy of kv_indptr up, a searchsorted to find each page's sequence, and no read-back, so building
it never waits for the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stallfree.kernels.attention import AttentionMetadata


@dataclass
class PagedKVIndices:
    qo_indptr: torch.Tensor  # host int32 [num_seqs + 1]
    kv_indptr: torch.Tensor  # host int32 [num_seqs + 1]
    kv_last_page_len: torch.Tensor  # host int32 [num_seqs]
    kv_indices: torch.Tensor  # device int32 [num_pages], on the block tables' device

    @property
    def num_pages(self) -> int:
        return self.kv_indices.shape[0]


def build_paged_kv_indices(metadata: AttentionMetadata) -> PagedKVIndices:
    page_size = metadata.block_size
    q_lens = torch.tensor(metadata.query_lens_host, dtype=torch.int32)
    seq_lens = torch.tensor(metadata.seq_lens_host, dtype=torch.int32)
    if (seq_lens < q_lens).any():
        raise ValueError("every sequence's seq_len must cover its query tokens (seq_len >= q_len)")
    pages = (seq_lens + page_size - 1) // page_size
    if pages.numel() and int(pages.max()) > metadata.block_tables.shape[1]:
        raise ValueError(f"a sequence needs {int(pages.max())} pages but the block tables hold "
                         f"{metadata.block_tables.shape[1]} per sequence")
    qo_indptr = _prefix_sums(q_lens)
    kv_indptr = _prefix_sums(pages)
    last_page_len = torch.where(pages > 0, seq_lens - (pages - 1) * page_size, 0).to(torch.int32)
    kv_indices = gather_kv_indices(metadata.block_tables, kv_indptr, int(kv_indptr[-1]))
    return PagedKVIndices(qo_indptr, kv_indptr, last_page_len, kv_indices)


def gather_kv_indices(block_tables: torch.Tensor, kv_indptr_host: torch.Tensor, num_pages: int) -> torch.Tensor:
    """The used prefix of every block-table row, rows laid end to end, computed where the tables live."""
    device = block_tables.device
    kv_indptr = kv_indptr_host.to(device, non_blocking=True)
    page_ids = torch.arange(num_pages, dtype=torch.int32, device=device)
    # Page i belongs to the last sequence whose first page is <= i.
    seq = torch.searchsorted(kv_indptr, page_ids, right=True) - 1
    within = page_ids - kv_indptr[seq]
    return block_tables[seq, within].to(torch.int32)


def _prefix_sums(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=out[1:])
    return out
