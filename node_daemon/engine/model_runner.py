"""The model runner: owns the model and its paged KV cache, turns a SchedulerOutput into logits.

Per iteration it lays the scheduled chunks end to end as one ragged batch (no padding), builds every
index tensor on the host in two packed buffers (int64: token ids, positions, slot mapping, sampled
rows; int32: query start locations, sequence lengths, block tables), copies each to the device once,
runs the model, and projects to logits only the rows that sample (every row of a draft's verification, which runs
as decode rows of its sequence).

Sampling is not done here (node_daemon/engine/sampler.py); the engine wires runner and sampler.
"""
from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from stallfree.kernels.attention import AttentionBackend, AttentionMetadata, select_backend
from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.engine.forward_path import ForwardPath, Path
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.kernels.cpu_threads import apply_threads
from stallfree.node_daemon.models.llama import KVCache
from stallfree.node_daemon.models.loader import LoadedModel, load_model
from stallfree.node_daemon.engine.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

# Without a cache size given, a CPU runner takes at most this much host memory for KV.
CPU_KV_CACHE_BYTES = 1 << 30
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


@dataclass
class ModelInputs:
    """One iteration's device-side inputs, built once and read by every layer."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64: the last row of each chunk that samples, every row of a verification
    is_decode_only: bool  # every chunk is one token (decode-shaped: the iterations CUDA graphs can replay)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, max_num_tokens: int,
                 max_num_seqs: int, loaded: LoadedModel | None = None) -> None:
        """`loaded`: serve an already loaded model (tests, or a benchmark reusing one) instead of loading
        model_config.model."""
        if max_num_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_num_tokens and max_num_seqs must be positive, got {max_num_tokens}, {max_num_seqs}")
        if cache_config.block_size < 1:
            raise ValueError(f"block_size must be positive, got {cache_config.block_size}")
        self.threads = apply_threads(model_config.threads) if model_config.device != "cuda" else None
        self.loaded: LoadedModel = loaded if loaded is not None else load_model(model_config)
        self.model = self.loaded.model
        self.device: torch.device = self.loaded.device
        self.block_size = cache_config.block_size
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = self.loaded.max_model_len
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.attn: AttentionBackend = select_backend(model_config.attention_backend, self.device)
        self.num_blocks = cache_config.num_blocks or self._num_blocks_from_memory(cache_config.kv_memory_fraction)
        self.kv_caches: list[KVCache] = self._allocate_kv_cache(self.num_blocks)
        # On CUDA the index buffers are staged in pinned host memory (asynchronous copies); on the CPU the
        # freshly built host tensors are the inputs themselves.
        self._staging: dict[torch.dtype, torch.Tensor] | None = None
        self._staging_copied = None  # a CUDA event: the last copies out of the staging buffers are done
        if self.device.type == "cuda":
            self._staging = self.allocate_staging_buffers(pin_memory=True)
            self._staging_copied = torch.cuda.Event()
        # --- The forward path (engine/forward_path.py), chosen per iteration by one object the runner owns. CUDA
        # graphs: with the KV cache allocated, decode-only graphs captured at bucketed batch sizes up to max_num_seqs
        # (none on the CPU, for a backend that cannot be captured, with STALLFREE_CUDA_GRAPHS=0).
        from stallfree.node_daemon.engine.cuda_graphs import DecodeCudaGraphs

        self.forward_path = self._forward_path(DecodeCudaGraphs.for_runner(self), model_config.compiled_decode)

    @property
    def cuda_graphs(self):
        """The captured decode graphs (engine/cuda_graphs.py), or None; a check may swap them for an A/B."""
        return self.forward_path.cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, graphs) -> None:
        self.forward_path.cuda_graphs = graphs

    @property
    def cpu_decode(self):
        """The compiled CPU forward (models/cpu_decode.py), or None; a benchmark may swap it for an A/B."""
        return self.forward_path.compiled

    @cpu_decode.setter
    def cpu_decode(self, compiled) -> None:
        self.forward_path.compiled = compiled

    # --- the per-iteration path ----------------------------------------------------------------------

    def execute_model(self, output: SchedulerOutput, all_logits: bool = False) -> torch.Tensor:
        """float32 logits [sampling rows, vocab] in chunk order ([num_tokens, vocab] with all_logits): one row per
        chunk that samples, 1 + len(draft) for a verification."""
        inputs = self.prepare_inputs(output)
        hidden = self.run_model(inputs)
        return self.model.compute_logits(hidden if all_logits else hidden[inputs.logits_indices])

    def run_model(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] for one iteration."""
        paths = self.forward_path
        paths.begin_iteration()
        path = paths.choose(inputs.input_ids.shape[0], inputs.is_decode_only, inputs)
        # Decode-only iterations may replay a captured CUDA graph instead of launching eagerly.
        if path is Path.CUDA_GRAPH:
            return paths.cuda_graphs.run(inputs)
        # The CPU's counterpart: the whole forward in one compiled call (decodes, and prefill chunks beside them).
        if path is Path.COMPILED:
            m = inputs.metadata
            return paths.compiled.forward(inputs.input_ids, inputs.positions, m.slot_mapping, m.block_tables,
                                          m.seq_lens, m.query_start_loc)
        self.attn.begin_iteration(inputs.metadata)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, self.attn)

    def prepare_inputs(self, output: SchedulerOutput) -> ModelInputs:
        if not output.chunks:
            raise ValueError("an iteration needs at least one scheduled chunk")
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        sample_rows: list[int] = []
        verifying = output.num_verify_tokens > 0
        seq_blocks: list[list[int]] | None = [] if verifying else None  # each sequence's block table
        for chunk in output.chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            end = start + n
            if end > self.max_model_len or end > len(req.block_ids) * bs:
                raise ValueError(f"request {req.request_id} reaches position {end}: past max_model_len "
                                 f"{self.max_model_len} or its {len(req.block_ids)} KV blocks")
            if chunk.draft:
                # A verification runs as 1 + len(draft) decode rows of one sequence, row i over the first
                # start + i + 1 positions: each row's logits are computed as a decode's would be (the same attention
                # kernel), so greedy outputs do not change with speculation. Every layer writes all rows' KV before
                # its attention, so each row sees the rows before it.
                ids.append(req.token_ids[start])
                ids += chunk.draft
                for pos in range(start, end):
                    positions.append(pos)
                    slots.append(req.block_ids[pos // bs] * bs + pos % bs)
                    query_start_loc.append(query_start_loc[-1] + 1)
                    query_lens.append(1)
                    seq_lens.append(pos + 1)
                    sample_rows.append(query_start_loc[-1] - 1)
                    seq_blocks.append(req.block_ids)
                continue
            if n == 1:  # a decode: the common case, kept to scalar arithmetic
                ids.append(req.token_ids[start])
                positions.append(start)
                slots.append(req.block_ids[start // bs] * bs + start % bs)
            else:
                ids += req.token_ids[start:end]
                positions += range(start, end)
                _append_slots(slots, req.block_ids, start, end, bs)
            query_start_loc.append(query_start_loc[-1] + n)
            query_lens.append(n)
            seq_lens.append(end)
            if seq_blocks is not None:
                seq_blocks.append(req.block_ids)
            if chunk.samples:
                sample_rows.append(query_start_loc[-1] - 1)
        num_tokens, num_seqs = len(ids), len(seq_lens)
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"{num_tokens} tokens scheduled, more than max_num_tokens {self.max_num_tokens}")
        max_seq_len = max(seq_lens)
        width = -(-max_seq_len // bs)
        block_tables: list[int] = []
        pad = [0] * width
        tables = seq_blocks if seq_blocks is not None else (chunk.request.block_ids for chunk in output.chunks)
        for blocks, seq_len in zip(tables, seq_lens):
            used = blocks[:-(-seq_len // bs)]
            block_tables += used
            block_tables += pad[len(used):]

        if self._staging_copied is not None:
            # An iteration that samples nothing never synchronises: wait for its copies before refilling.
            self._staging_copied.synchronize()
        i64 = self._to_device(ids + positions + slots + sample_rows, torch.int64)
        i32 = self._to_device(query_start_loc + seq_lens + block_tables, torch.int32)
        if self._staging_copied is not None:
            self._staging_copied.record()
        metadata = AttentionMetadata(
            query_start_loc=i32[:num_seqs + 1],
            seq_lens=i32[num_seqs + 1:2 * num_seqs + 1],
            block_tables=i32[2 * num_seqs + 1:].view(num_seqs, width),
            slot_mapping=i64[2 * num_tokens:3 * num_tokens],
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            block_size=bs,
        )
        return ModelInputs(
            input_ids=i64[:num_tokens],
            positions=i64[num_tokens:2 * num_tokens],
            metadata=metadata,
            logits_indices=i64[3 * num_tokens:],
            is_decode_only=num_tokens == num_seqs,
        )

    def allocate_staging_buffers(self, pin_memory: bool) -> dict[torch.dtype, torch.Tensor]:
        """Host buffers for the packed index tensors, sized by the ceilings (bigger iterations bypass them)."""
        i64 = 3 * self.max_num_tokens + self.max_num_seqs
        i32 = 2 * self.max_num_seqs + 1 + self.max_num_seqs * self.max_blocks_per_seq
        return {torch.int64: torch.empty(i64, dtype=torch.int64, pin_memory=pin_memory),
                torch.int32: torch.empty(i32, dtype=torch.int32, pin_memory=pin_memory)}

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """One host tensor, one copy (through the staging buffer when there is one and it is big enough)."""
        if self._staging is None or len(values) > self._staging[dtype].numel():
            # numpy converts a list of ints several times faster than torch.tensor does.
            return torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype])).to(self.device)
        host = self._staging[dtype][:len(values)]
        host.numpy()[:] = values
        return host.to(self.device, non_blocking=True)

    def _forward_path(self, cuda_graphs, mode: str) -> ForwardPath:
        """The runner's forward path: CUDA graphs when captured, the compiled CPU forward (models/cpu_decode.py) when
        asked for and the model suits it (taken up between iterations once it has loaded), else eager."""
        if mode not in ("off", "background", "now"):
            raise ValueError(f"compiled_decode must be off, background or now, got {mode!r}")
        if mode == "off" or self.device.type != "cpu" or getattr(self.attn, "name", None) != "cpu":
            return ForwardPath(cuda_graphs, None, lambda: False, lambda: None)
        from stallfree.node_daemon.models import cpu_decode

        why = cpu_decode.unsupported(self.model)
        if why is None and cpu_decode.ensure_built(background=mode == "background") is False:
            why = cpu_decode.why_not()
            if why and why.startswith("compiling"):
                log.info("compiled decode path: %s", why)
                # Taken up at the first iteration after it has loaded.
                return ForwardPath(cuda_graphs, cpu_decode.CpuDecode(self.model, self.kv_caches),
                                   cpu_decode.is_loaded, self._take_up_compiled)
        if why is not None:
            log.info("compiled decode path off: %s", why)
            return ForwardPath(cuda_graphs, None, lambda: False, lambda: None)
        compiled = cpu_decode.CpuDecode(self.model, self.kv_caches)
        log.info("compiled forward: decode-only iterations of up to %d rows%s", compiled.max_rows,
                 ", and iterations with prefill chunks" if compiled.mixed else "")
        return ForwardPath(cuda_graphs, compiled, cpu_decode.is_loaded, self._take_up_compiled)

    def _take_up_compiled(self) -> None:
        """Between iterations, once the compiled extension has loaded: its code kernel serves every quantized
        matmul from the next forward on."""
        from stallfree.node_daemon.models import cpu_decode

        cpu_decode.publish_code_kernel(self.model)
        self._release_int4_packs()

    def _release_int4_packs(self) -> None:
        """With the code kernel serving every quantized matmul (models/quantized.py) torch's int4 packs, the Python
        path's until then, are dropped, so each weight is held once as its codes."""
        from stallfree.node_daemon.models import cpu_decode

        if self.model.code_kernel_in_use and cpu_decode.enabled(cpu_decode.CODE_KERNEL_SWITCH):
            freed = self.model.release_int4_packs()
            if freed:
                log.info("torch's int4 packs released (%.0f MB): the code kernel serves the GGUF codes", freed / 1e6)

    # --- KV cache --------------------------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.loaded.dtype).element_size()
        return self.block_size * self.loaded.shape.kv_bytes_per_token(itemsize)

    def _num_blocks_from_memory(self, kv_memory_fraction: float) -> int:
        if not 0.0 < kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction}")
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * kv_memory_fraction)
        else:
            # Enough for every sequence at full context, but no more than a fixed share of host memory.
            want = self.max_num_seqs * self.max_blocks_per_seq * self.kv_bytes_per_block
            budget = min(want, CPU_KV_CACHE_BYTES)
        num_blocks = budget // self.kv_bytes_per_block
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(f"the KV cache fits only {num_blocks} blocks of {self.block_size} tokens, fewer than "
                             f"one sequence of max_model_len {self.max_model_len} needs ({self.max_blocks_per_seq}); "
                             f"lower --max-model-len or give --num-kv-blocks")
        return num_blocks

    def _allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        shape = self.loaded.shape
        # The backend's layout (head-major on the CPU), else NHD [num_blocks, block_size, kv_heads, head_dim].
        cache_shape = getattr(self.attn, "cache_shape", None)
        per_layer = (cache_shape(num_blocks, self.block_size, shape.num_kv_heads, shape.head_dim) if cache_shape
                     else (num_blocks, self.block_size, shape.num_kv_heads, shape.head_dim))
        # One allocation; zeros so that padded block-table entries never read NaN garbage.
        full = (shape.num_layers, 2, *per_layer)
        if self.device.type == "cpu":
            cache = _lazily_zeroed(full, self.loaded.dtype)
        else:
            cache = torch.zeros(full, dtype=self.loaded.dtype, device=self.device)
        return [(cache[i, 0], cache[i, 1]) for i in range(shape.num_layers)]


def _lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in fresh anonymous pages, which the kernel hands out (zeroed) as they are first written: the
    process's RSS follows the KV blocks used, not the cache's size (torch.zeros writes every byte at start-up,
    1 GiB resident before a request). Huge pages are refused for it: with THP on, the first token written into
    each of the cache's (layer, k/v, head) planes zeroed a 2 MiB page, 360 MiB on the first decode (~1 s here)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = max(1, int(np.prod(shape)) * itemsize)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def _append_slots(slots: list[int], block_ids: list[int], start: int, end: int, block_size: int) -> None:
    """Cache slots of positions start..end-1, one range per block touched."""
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        take = min(block_size - offset, end - pos)
        base = block_ids[block] * block_size + offset
        slots += range(base, base + take)
        pos += take
