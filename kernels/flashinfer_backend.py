"""AttentionBackend over flashinfer's paged-KV batch prefill: one plan per iteration for the whole mixed batch.

flashinfer's BatchPrefillWithPagedKVCacheWrapper treats a decode as a one-token append, so decodes and
prefill chunks share one plan and one launch per layer. Its causal mask for an append is aligned to the
bottom right (query i of a chunk sees the cached prefix plus its own chunk up to i), which is this
engine's convention. The cache is NHD, the layout kernels/attention.py fixes.

Planning. begin_iteration() builds the CSR indices (kernels/flashinfer_index.py); the first forward()
of the iteration plans (heads, head_dim and dtype are known only there) and every later layer reuses
that plan. The float workspace is allocated once and reused by every plan.

CUDA graphs. A captured decode graph must read its indices from fixed addresses, so graph mode keeps
one wrapper per batch-size bucket built with use_cuda_graph=True and fixed index buffers;
node_daemon/engine/cuda_graphs.py selects the bucket with use_cuda_graph_batch() and calls begin_iteration(),
which then plans at once (outside the graph) so that the replay sees this step's pages.

Keys and values are written by the Triton KV write kernel (slot -1 skipped), so both CUDA backends
store the cache the same way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from stallfree.kernels.attention import AttentionMetadata
from stallfree.kernels.flashinfer_index import PagedKVIndices, build_paged_kv_indices

WORKSPACE_BYTES = 256 << 20  # flashinfer recommends 128 MiB; split-KV plans over long batches use more


@dataclass(frozen=True)
class _Problem:
    """What a plan depends on besides the batch: fixed for a model, learnt from the first forward()."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scale: float


def import_flashinfer():
    """flashinfer, imported the one way this engine imports it: flashinfer.norm picks its RMSNorm at import time,
    and its default is a CuTe-DSL kernel compiled at run time (nvidia-cutlass-dsl, absent from the ahead-of-time
    bundle); FLASHINFER_USE_CUDA_NORM=1 keeps the CUDA kernel the bundle carries, whichever module imports first."""
    os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError("the flashinfer attention backend needs the flashinfer-python package "
                          "(pip install 'stallfree[gpu]'; for a machine without network see e2e/gpu/README.md); "
                          "choose --attention-backend triton or auto instead") from exc
    return flashinfer


KERNEL_BACKENDS = ("auto", "fa2", "fa3")


def resolve_kernel_backend(explicit: str | None) -> str:
    """flashinfer's kernel family: the argument, else STALLFREE_FLASHINFER_BACKEND, else auto (FA3 on Hopper
    for long queries, FA2 for short). fa2 is pinned where only FA2 kernels were built ahead of time; a bad
    name fails here, not at the first plan on the GPU."""
    name = explicit or os.environ.get("STALLFREE_FLASHINFER_BACKEND") or "auto"
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"flashinfer kernel backend {name!r}: choose one of {', '.join(KERNEL_BACKENDS)} "
                         f"(STALLFREE_FLASHINFER_BACKEND)")
    return name


class FlashInferBackend:
    name = "flashinfer"
    supports_cuda_graphs = True  # through use_cuda_graph_batch(): fixed-buffer wrappers planned before replay

    def __init__(self, device: torch.device | str, workspace_bytes: int = WORKSPACE_BYTES,
                 kernel_backend: str | None = None, flashinfer_module=None) -> None:
        """`flashinfer_module` replaces the real package (tests of the planning logic on the CPU)."""
        self.device = torch.device(device)
        if self.device.type != "cuda" and flashinfer_module is None:
            raise ValueError(f"the flashinfer backend runs on CUDA devices only, not {self.device}; "
                             f"use --attention-backend torch on the CPU")
        self._flashinfer = flashinfer_module or import_flashinfer()
        self._kernel_backend = resolve_kernel_backend(kernel_backend)
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        # The resolved family, never the argument: flashinfer's plan() asserts on backend=None.
        self._wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=self._kernel_backend)
        self._indices: PagedKVIndices | None = None
        self._metadata: AttentionMetadata | None = None
        self._planned: _Problem | None = None  # the problem the current iteration's plan was made for
        self._problem: _Problem | None = None  # the last problem seen (graph mode plans with it)
        self._graph_batch: int | None = None
        self._graph_wrappers: dict[int, object] = {}
        self._graph_max_pages = 0

    # --- AttentionBackend ------------------------------------------------------------------------------

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        from stallfree.kernels.triton_kv_write import write_kv

        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def begin_iteration(self, metadata: AttentionMetadata) -> None:
        self._metadata = metadata
        self._indices = build_paged_kv_indices(metadata)
        self._planned = None
        if self._graph_batch is not None:
            if self._problem is None:
                raise RuntimeError("flashinfer graph mode needs one eager iteration first (to learn heads and dtype)")
            self._plan(self._graph_wrapper(self._graph_batch), self._problem)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if metadata is not self._metadata:
            raise RuntimeError("FlashInferBackend.forward() with metadata begin_iteration() did not plan")
        if self._graph_batch is not None:
            return self._graph_wrapper(self._graph_batch).run(query, (k_cache, v_cache))
        problem = _Problem(query.shape[1], k_cache.shape[2], query.shape[2], query.dtype, k_cache.dtype, scale)
        if problem != self._planned:
            self._plan(self._wrapper, problem)
        return self._wrapper.run(query, (k_cache, v_cache))

    # --- CUDA graphs ---------------------------------------------------------------------------------

    def use_cuda_graph_batch(self, batch_size: int | None, max_pages_per_seq: int = 0) -> None:
        """Route the next iterations through the fixed-buffer wrapper of this batch size (None: eager)."""
        self._graph_batch = batch_size
        self._graph_max_pages = max(self._graph_max_pages, max_pages_per_seq)

    def _graph_wrapper(self, batch_size: int):
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is None:
            if self._graph_max_pages < 1:
                raise RuntimeError("use_cuda_graph_batch() needs max_pages_per_seq for its index buffer")
            i32 = dict(dtype=torch.int32, device=self.device)
            wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(batch_size + 1, **i32),
                paged_kv_indptr_buf=torch.zeros(batch_size + 1, **i32),
                paged_kv_indices_buf=torch.zeros(batch_size * self._graph_max_pages, **i32),
                paged_kv_last_page_len_buf=torch.zeros(batch_size, **i32),
                backend=self._kernel_backend,
            )
            self._graph_wrappers[batch_size] = wrapper
        return wrapper

    # --- planning ------------------------------------------------------------------------------------

    def _plan(self, wrapper, problem: _Problem) -> None:
        idx = self._indices
        assert idx is not None and self._metadata is not None
        wrapper.plan(
            idx.qo_indptr, idx.kv_indptr, idx.kv_indices, idx.kv_last_page_len,
            problem.num_qo_heads, problem.num_kv_heads, problem.head_dim, self._metadata.block_size,
            causal=True, sm_scale=problem.scale,
            q_data_type=problem.q_dtype, kv_data_type=problem.kv_dtype,
        )
        self._planned = problem
        self._problem = problem
