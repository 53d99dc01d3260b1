"""Decode CUDA graphs, the parts a CPU can check: buckets, and staging a padded step into static buffers.

The replay itself needs a GPU (e2e/gpu/gpu_check.py checks it); here the staged buffers are run eagerly
through the real model and must give the unpadded step's hidden states and write only its slots.
"""
from __future__ import annotations

import pytest
import torch

from model_helpers import make_request, tiny_runner
from stallfree.node_daemon.engine.cuda_graphs import DecodeCudaGraphs, graph_batch_sizes
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput


def test_buckets_cover_every_batch_up_to_the_ceiling():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and all(b % 8 == 0 for b in sizes[3:])
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def _graphs_for(runner, batch_sizes):
    def forward(ids, pos, md):
        return runner.model(ids, pos, runner.kv_caches, md, runner.attn)

    return DecodeCudaGraphs(forward, runner.attn, batch_sizes, runner.max_blocks_per_seq, runner.block_size,
                            runner.max_model_len, runner.device)


def test_bucket_is_the_smallest_that_fits():
    graphs = _graphs_for(tiny_runner(num_blocks=8), [1, 2, 4, 8])
    assert [graphs.bucket_for(b) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="exceed"):
        graphs.bucket_for(9)


def test_no_graphs_on_the_cpu():
    assert DecodeCudaGraphs.for_runner(tiny_runner(num_blocks=8)) is None


def test_staged_padded_step_equals_the_eager_step():
    runner = tiny_runner(num_blocks=32, attention_backend="torch")  # NHD, the layout of the graph-capable backends
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    reqs = []
    for i, n in enumerate((5, 19, 33)):
        prompt = torch.randint(0, runner.loaded.shape.vocab_size, (n,), generator=gen).tolist()
        req = make_request(f"r{i}", prompt, [8 * i + j for j in range(4)])
        runner.execute_model(SchedulerOutput(chunks=[ScheduledChunk(req, 0, n, True, True)]))
        req.append_output_token(int(torch.randint(0, 100, (1,), generator=gen)))
        reqs.append(req)
    decode = SchedulerOutput(chunks=[ScheduledChunk(r, r.num_tokens - 1, 1, False, True) for r in reqs])
    inputs = runner.prepare_inputs(decode)
    assert inputs.is_decode_only

    graphs = _graphs_for(runner, [1, 2, 4, 8])
    assert graphs.can_run(inputs)
    # Dirty the static buffers as an earlier, larger step would have left them.
    graphs.block_tables.random_(0, 32)
    graphs.seq_lens.fill_(7)
    graphs.slot_mapping.fill_(3)
    cache_before = [k.clone() for k, _ in runner.kv_caches]
    metadata = graphs.stage(inputs.input_ids, inputs.positions, inputs.metadata, bucket=4)
    assert metadata.num_seqs == 4 and metadata.slot_mapping.tolist()[3] == -1
    staged = graphs.forward(graphs.input_ids[:4], graphs.positions[:4], metadata)[:3]

    # Exactly the three real tokens' slots were written, in every layer: padding wrote nothing.
    written = {int(s) for s in inputs.metadata.slot_mapping}
    for (k, _), before in zip(runner.kv_caches, cache_before):
        blocks, offsets = (k != before).any(-1).any(-1).nonzero(as_tuple=True)
        assert {b * runner.block_size + o for b, o in zip(blocks.tolist(), offsets.tolist())} == written
    eager = runner.run_model(inputs)
    assert torch.allclose(staged, eager, rtol=1e-5, atol=1e-5)
