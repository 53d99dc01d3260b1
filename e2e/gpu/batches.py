"""The batches the GPU check runs: attention-level ragged batches over a paged cache, and engine iterations.

Blocks are handed out in a random order (as a block pool would after churn) and every cache slot is
random data, never zeros: zeros hide unwritten outputs and can run faster than real data.
"""
from __future__ import annotations

import torch

from stallfree.kernels.attention import AttentionMetadata
from stallfree.node_daemon.engine.request import Request
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput

from roofline import Sequence

# Named batch mixes of (q_len, seq_len); every case of the CPU tests, at GPU sizes.
CORRECTNESS_CASES: dict[str, list[tuple[int, int]]] = {
    "decodes": [(1, 1), (1, 17), (1, 1000), (1, 257), (1, 4097)],
    "prefills": [(7, 7), (300, 300), (129, 129)],
    "chunked": [(64, 1100), (333, 400), (5, 2049)],
    "mixed": [(1, 45), (1, 3000), (1, 64), (511, 1535), (256, 256), (1, 30)],
}
# The same kinds at the CPU tests' sizes (tests/test_triton_kernels.py): the dry run's, under the interpreter.
CPU_CORRECTNESS_CASES: dict[str, list[tuple[int, int]]] = {
    "decodes": [(1, 1), (1, 17), (1, 50)],
    "prefills": [(7, 7), (33, 33)],
    "chunked": [(9, 40), (5, 70)],
    "mixed": [(1, 45), (23, 61), (13, 13), (1, 30)],
}
CASE_SETS = {"gpu": CORRECTNESS_CASES, "cpu": CPU_CORRECTNESS_CASES}


def decode_batch(batch_size: int, context: int) -> list[Sequence]:
    return [Sequence(1, context)] * batch_size


def mixed_batch(num_tokens: int, num_decodes: int, context: int, chunk_prefix: int) -> list[Sequence]:
    """num_decodes decodes at `context`, then one prefill chunk filling the iteration to num_tokens tokens
    over a cached prefix of chunk_prefix tokens (stall-free batching's steady state)."""
    chunk = num_tokens - num_decodes
    if chunk < 1:
        raise ValueError(f"{num_decodes} decodes leave no room for a chunk in {num_tokens} tokens")
    return [Sequence(1, context)] * num_decodes + [Sequence(chunk, chunk_prefix + chunk)]


def attention_inputs(batch: list[Sequence], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype, device: torch.device, gen: torch.Generator, spare_blocks: int = 8):
    """(query, k_cache, v_cache, metadata) for one layer, all on `device`, the cache random."""
    pages = [-(-s.seq_len // block_size) for s in batch]
    num_blocks = sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen, device="cpu")
    width = max(pages)
    tables = torch.zeros((len(batch), width), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        tables[i, :n] = order[used:used + n]
        used += n
    q_lens = [s.q_len for s in batch]
    seq_lens = [s.seq_len for s in batch]
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    num_tokens = sum(q_lens)
    # Slots of the new tokens (the tail of each sequence), for KV-write checks.
    slots = []
    for i, s in enumerate(batch):
        for pos in range(s.seq_len - s.q_len, s.seq_len):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    metadata = AttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=tables.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_lens_host=q_lens, seq_lens_host=seq_lens,
        block_size=block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=torch.float32, generator=_device_gen(gen, device)).to(dtype)
    v_cache = torch.randn(shape, device=device, dtype=torch.float32, generator=_device_gen(gen, device)).to(dtype)
    query = torch.randn((num_tokens, num_heads, head_dim), device=device, generator=_device_gen(gen, device)).to(dtype)
    return query, k_cache, v_cache, metadata


def _device_gen(gen: torch.Generator, device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return gen
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def engine_iteration(batch: list[Sequence], block_size: int, vocab_size: int, first_block: int = 0,
                     gen: torch.Generator | None = None) -> tuple[SchedulerOutput, int]:
    """A SchedulerOutput for `batch` with disjoint KV blocks from first_block on; returns it and the next free block.

    Prompts are random token ids; a decode is a request whose last prompt token is the new one.
    """
    gen = gen or torch.Generator().manual_seed(0)
    chunks = []
    block = first_block
    for i, s in enumerate(batch):
        prompt = torch.randint(0, vocab_size, (s.seq_len,), generator=gen).tolist()
        req = Request(f"gpu-check-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        n_blocks = -(-s.seq_len // block_size)
        req.block_ids = list(range(block, block + n_blocks))
        block += n_blocks
        start = s.seq_len - s.q_len
        req.num_computed_tokens = start
        chunks.append(ScheduledChunk(req, start, s.q_len, is_prefill=s.q_len > 1, samples=True))
    decodes = sum(1 for s in batch if s.q_len == 1)
    out = SchedulerOutput(chunks=chunks, num_decode_tokens=decodes,
                          num_prefill_tokens=sum(s.q_len for s in batch) - decodes)
    return out, block
