"""CUDA graphs for decode-only iterations, captured at bucketed batch sizes up to the max_num_seqs ceiling.

A decode step of a small model is dominated by launch overhead: hundreds of kernels of a few
microseconds each. Replaying a captured graph launches them all at once. Graphs fix shapes and
addresses, so:

- each bucket B (1, 2, 4, 8, then every multiple of 8 up to the ceiling) has one graph, captured once
  at start over static input buffers; a step of b <= B decodes runs the smallest bucket that fits,
  padded with B - b dummy sequences (one token over one cached position, slot -1 so nothing is
  written; their rows are discarded);
- mixed iterations (any prefill chunk) run eagerly: their shapes vary every step;
- only backends that read every per-step figure from device memory can be captured (`supports_cuda_graphs`):
  the Triton kernels do; flashinfer does with fixed-buffer wrappers that are planned before each replay
  (use_cuda_graph_batch); the torch reference loops over host lists and cannot.

The runner hook: ModelRunner sets `self.cuda_graphs = DecodeCudaGraphs.for_runner(self)` and calls
can_run()/run() for decode-only iterations. STALLFREE_CUDA_GRAPHS=0 turns capture off (eager always).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

import torch

from stallfree.kernels.attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from stallfree.node_daemon.engine.model_runner import ModelInputs, ModelRunner

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured buckets: 1, 2, 4, 8, 16, 24, ... up to and including the max_num_seqs ceiling."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def cuda_graphs_enabled() -> bool:
    return os.environ.get("STALLFREE_CUDA_GRAPHS", "1") not in ("0", "false", "no", "off")


class DecodeCudaGraphs:
    """Static decode buffers of the largest bucket, one graph per bucket, replay with padding."""

    def __init__(self, forward: ForwardFn, attn: AttentionBackend, batch_sizes: list[int], max_blocks_per_seq: int,
                 block_size: int, max_model_len: int, device: torch.device) -> None:
        self.forward = forward
        self.attn = attn
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        m = self.max_batch
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((m,), -1, dtype=torch.int64, device=device)
        # Every sequence of a decode step has one query token: the start locations never change.
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(m, dtype=torch.int32, device=device)
        # Stale rows only ever hold valid block ids (zeros, or an earlier step's), so padding reads are safe.
        self.block_tables = torch.zeros((m, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._static_metadata: dict[int, AttentionMetadata] = {}

    @classmethod
    def for_runner(cls, runner: "ModelRunner", batch_sizes: list[int] | None = None) -> "DecodeCudaGraphs | None":
        """Capture graphs for a runner's model, or None where graphs are off, unsupported or not on CUDA."""
        if runner.device.type != "cuda" or not cuda_graphs_enabled():
            return None
        if not getattr(runner.attn, "supports_cuda_graphs", False) or not runner.model.graph_capturable:
            return None
        model, kv_caches, attn = runner.model, runner.kv_caches, runner.attn

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
            return model(input_ids, positions, kv_caches, metadata, attn)

        graphs = cls(forward, attn, batch_sizes or graph_batch_sizes(runner.max_num_seqs), runner.max_blocks_per_seq,
                     runner.block_size, runner.max_model_len, runner.device)
        graphs.capture()
        return graphs

    # --- the runner's interface ---------------------------------------------------------------------------

    def can_run(self, inputs: "ModelInputs") -> bool:
        md = inputs.metadata
        return (inputs.is_decode_only and md.num_seqs <= self.max_batch
                and md.block_tables.shape[1] <= self.max_blocks_per_seq)

    def run(self, inputs: "ModelInputs") -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a decode-only step, by graph replay."""
        b = inputs.metadata.num_seqs
        bucket = self.bucket_for(b)
        metadata = self.stage(inputs.input_ids, inputs.positions, inputs.metadata, bucket)
        self._plan(bucket, metadata)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b]

    # --- staging and capture ----------------------------------------------------------------------------

    def bucket_for(self, num_seqs: int) -> int:
        for size in self.batch_sizes:
            if size >= num_seqs:
                return size
        raise ValueError(f"{num_seqs} sequences exceed the largest captured batch {self.max_batch}")

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
              bucket: int) -> AttentionMetadata:
        """Copy one decode step into the static buffers, pad to `bucket`, and return the bucket's metadata
        (its device tensors are the graph's; its host lists describe this step, for planners)."""
        b = metadata.num_seqs
        width = metadata.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(metadata.seq_lens, non_blocking=True)
        self.block_tables[:b, :width].copy_(metadata.block_tables, non_blocking=True)
        if bucket > b:
            self.input_ids[b:bucket].zero_()
            self.positions[b:bucket].zero_()
            self.slot_mapping[b:bucket].fill_(-1)
            self.seq_lens[b:bucket].fill_(1)
        return self._metadata(bucket, metadata.seq_lens_host + [1] * (bucket - b), metadata.max_seq_len)

    def _metadata(self, bucket: int, seq_lens_host: list[int], max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_lens_host=[1] * bucket,
            seq_lens_host=seq_lens_host,
            block_size=self.block_size,
        )

    def _plan(self, bucket: int, metadata: AttentionMetadata) -> None:
        """Host-side planning for backends that need it (flashinfer), into the bucket's fixed buffers."""
        select = getattr(self.attn, "use_cuda_graph_batch", None)
        if select is None:
            return
        select(bucket, self.max_blocks_per_seq)
        try:
            self.attn.begin_iteration(metadata)
        finally:
            select(None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        pool = torch.cuda.graph_pool_handle()
        # Kernel launch parameters fixed at capture (Triton's split-KV count) are chosen for the longest
        # context the engine serves; each program still sizes its work from the device-side lengths.
        for bucket in reversed(self.batch_sizes):
            metadata = self._metadata(bucket, [1] * bucket, self.max_model_len)
            for _ in range(2):  # eager warm-up: kernel compilation, cuBLAS handles, flashinfer's problem shape
                self.attn.begin_iteration(metadata)
                self.forward(self.input_ids[:bucket], self.positions[:bucket], metadata)
            torch.cuda.synchronize(self.device)
            select = getattr(self.attn, "use_cuda_graph_batch", None)
            if select is not None:
                select(bucket, self.max_blocks_per_seq)
            try:
                self.attn.begin_iteration(metadata)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(self.input_ids[:bucket], self.positions[:bucket], metadata)
            finally:
                if select is not None:
                    select(None)
            self.graphs[bucket] = graph
            self.outputs[bucket] = out
            self._static_metadata[bucket] = metadata
        torch.cuda.synchronize(self.device)
