"""FlashInferBackend through flashinfer's real wrapper and plan() on the CPU (tests/flashinfer_cpu.py stubs only
what needs CUDA): the kernel family reaching the plan, the host metadata flashinfer derives from our arrays, and
flashinfer's own append addressing (its Triton kernel, interpreted) landing on the engine's slots.
Skipped where flashinfer-python is not installed (CI installs the daemon and test extras only)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from flashinfer_cpu import attend_as_flashinfer, cpu_flashinfer  # noqa: F401 (fixture)
from model_helpers import make_request, tiny_runner
from stallfree.kernels import torch_reference
from stallfree.kernels.flashinfer_backend import FlashInferBackend
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from test_flashinfer_index import random_metadata


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _backend(flashinfer) -> FlashInferBackend:
    return FlashInferBackend("cpu", workspace_bytes=1 << 20, flashinfer_module=flashinfer)


def _inputs(md, heads: int, kv_heads: int, dim: int, gen: torch.Generator):
    blocks = int(md.block_tables.max()) + 1
    q = torch.randn(md.num_tokens, heads, dim, generator=gen).bfloat16()
    k = torch.randn(blocks, md.block_size, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(blocks, md.block_size, kv_heads, dim, generator=gen).bfloat16()
    return q, k, v


@pytest.mark.parametrize("family", ["fa2", "fa3"])
def test_pinned_family_reaches_flashinfers_plan(cpu_flashinfer, monkeypatch, family):
    """STALLFREE_FLASHINFER_BACKEND picks the module flashinfer plans with (with backend=None its plan() asserts)."""
    flashinfer, recorder = cpu_flashinfer
    monkeypatch.setenv("STALLFREE_FLASHINFER_BACKEND", family)
    backend = _backend(flashinfer)
    md = random_metadata(random.Random(_seed()), 16, 4)
    backend.begin_iteration(md)
    q, k, v = _inputs(md, 8, 2, 64, torch.Generator().manual_seed(0))
    backend._wrapper.run = lambda query, kv, out=None: attend_as_flashinfer(backend._wrapper, query, *kv)
    backend.forward(q, k, v, md, 0.125)
    assert recorder.families == [family]


@pytest.mark.parametrize("page_size", [16, 32])
def test_flashinfers_host_metadata_is_our_batch(cpu_flashinfer, monkeypatch, page_size):
    """The lengths, rows and batch size flashinfer's plan() derives from our CSR arrays are the metadata's."""
    flashinfer, recorder = cpu_flashinfer
    monkeypatch.setenv("STALLFREE_FLASHINFER_BACKEND", "fa2")
    seed = _seed()
    rng = random.Random(seed)
    backend = _backend(flashinfer)
    for _ in range(5):
        md = random_metadata(rng, page_size, rng.randint(1, 10))
        backend.begin_iteration(md)
        backend._plan(backend._wrapper, _problem(heads=32, kv_heads=8, dim=128))
        got = recorder.host_metadata()
        assert got["kv_lens"] == md.seq_lens_host, f"seed {seed}"
        assert got["qo_indptr"] == md.query_start_loc.tolist(), f"seed {seed}"
        assert got["total_rows"] == md.num_tokens and got["batch_size"] == md.num_seqs, f"seed {seed}"
        assert (got["num_qo_heads"], got["num_kv_heads"], got["head_dim"], got["page_size"]) == (32, 8, 128, page_size)
        assert got["causal"] is True and got["cuda_graph"] is False


def test_planned_buffers_attend_like_the_reference(cpu_flashinfer, monkeypatch):
    """What the real plan() stored, read as flashinfer's kernel reads it, is the reference's attention."""
    flashinfer, _ = cpu_flashinfer
    monkeypatch.setenv("STALLFREE_FLASHINFER_BACKEND", "fa2")
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    backend = _backend(flashinfer)
    md = random_metadata(random.Random(seed), 16, 7)
    q, k, v = _inputs(md, 12, 4, 32, gen)
    backend.begin_iteration(md)
    backend._wrapper.run = lambda query, kv, out=None: attend_as_flashinfer(backend._wrapper, query, *kv)
    got = backend.forward(q, k, v, md, 0.2)
    want = torch_reference.paged_attention(q.double(), k.double(), v.double(), md, 0.2, compute_dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-12), f"seed {seed}"


def test_graph_wrapper_buffers_take_each_steps_pages(cpu_flashinfer, monkeypatch):
    """Graph mode: the real fixed-buffer wrapper copies every step's arrays into the same buffers."""
    flashinfer, recorder = cpu_flashinfer
    monkeypatch.setenv("STALLFREE_FLASHINFER_BACKEND", "fa2")
    rng = random.Random(_seed())
    backend = _backend(flashinfer)
    first = random_metadata(rng, 16, 3)
    backend.begin_iteration(first)
    backend._plan(backend._wrapper, _problem(heads=8, kv_heads=2, dim=64))  # the eager step teaches the shape
    backend.use_cuda_graph_batch(3, max_pages_per_seq=16)
    addresses = None
    for _ in range(3):
        md = decode_metadata(rng, 16, 3)  # graph mode runs decode-only steps: one row per sequence
        backend.begin_iteration(md)
        wrapper = backend._graph_wrapper(3)
        indices = backend._indices
        n = indices.num_pages
        assert torch.equal(wrapper._paged_kv_indices_buf[:n], indices.kv_indices)
        assert torch.equal(wrapper._paged_kv_indptr_buf, indices.kv_indptr)
        assert torch.equal(wrapper._paged_kv_last_page_len_buf, indices.kv_last_page_len)
        assert recorder.host_metadata()["cuda_graph"] is True and recorder.families[-1] == "fa2"
        now = (wrapper._qo_indptr_buf.data_ptr(), wrapper._paged_kv_indices_buf.data_ptr())
        assert addresses in (None, now)  # a captured graph reads these addresses: they never move
        addresses = now
    backend.use_cuda_graph_batch(None)


def test_flashinfers_append_positions_land_on_the_engines_slots(cpu_flashinfer):
    """flashinfer's own batch-indices/positions kernel (Triton, interpreted here) over the runner's metadata:
    the positions are the runner's, and the pages it would append to through our kv_indices are its slots."""
    flashinfer, _ = cpu_flashinfer
    import importlib

    import flashinfer.triton.page as triton_page

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.reload(triton_page)  # decorated again under the interpreter
        from stallfree.kernels.flashinfer_index import build_paged_kv_indices

        runner = tiny_runner(num_blocks=64)
        rng = random.Random(_seed())
        blocks = rng.sample(range(64), 20)
        decode = make_request("d", list(range(40)), blocks[:3])
        decode.num_computed_tokens = 39
        chunk = make_request("c", list(range(70)), blocks[3:8])
        chunk.num_computed_tokens = 30
        fresh = make_request("f", list(range(9)), blocks[8:9])
        output = SchedulerOutput(chunks=[ScheduledChunk(decode, 39, 1, is_prefill=False, samples=True),
                                         ScheduledChunk(chunk, 30, 33, is_prefill=True, samples=False),
                                         ScheduledChunk(fresh, 0, 9, is_prefill=True, samples=True)])
        inputs = runner.prepare_inputs(output)
        md = inputs.metadata
        idx = build_paged_kv_indices(md)
        seq_lens = torch.tensor(md.seq_lens_host, dtype=torch.int32)
        batch, positions = flashinfer.page.get_batch_indices_positions(idx.qo_indptr, seq_lens, md.num_tokens)
        assert torch.equal(positions.long(), inputs.positions.cpu())
        page = idx.kv_indices[(idx.kv_indptr[batch.long()] + positions // md.block_size).long()]
        slots = page.long() * md.block_size + positions.long() % md.block_size
        assert torch.equal(slots, md.slot_mapping.cpu())
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
        importlib.reload(triton_page)


def decode_metadata(rng: random.Random, page_size: int, num_seqs: int):
    """A decode-only step over random lengths and shuffled pages (what a captured graph replays)."""
    from stallfree.kernels.attention import AttentionMetadata

    seq_lens = [rng.randint(1, 200) for _ in range(num_seqs)]
    pages = [-(-n // page_size) for n in seq_lens]
    pool = rng.sample(range(sum(pages) + 5), sum(pages))
    tables = torch.zeros((num_seqs, max(pages)), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        tables[i, :n] = torch.tensor(pool[used:used + n])
        used += n
    return AttentionMetadata(torch.arange(num_seqs + 1, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             tables, torch.zeros(num_seqs, dtype=torch.int64), 1, max(seq_lens), [1] * num_seqs,
                             seq_lens, page_size)


def _problem(heads: int, kv_heads: int, dim: int):
    from stallfree.kernels.flashinfer_backend import _Problem

    return _Problem(heads, kv_heads, dim, torch.bfloat16, torch.bfloat16, dim ** -0.5)
