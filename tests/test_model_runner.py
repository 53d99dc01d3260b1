"""ModelRunner: KV cache sizing, the ragged batch it builds from a SchedulerOutput, logits in chunk order."""
from __future__ import annotations

import pytest
import torch

import stallfree.node_daemon.engine.model_runner as model_runner
from model_helpers import make_request, prefill_all_rows, step, tiny_runner
from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput


def test_kv_cache_layout_and_default_size_on_cpu():
    runner = ModelRunner(ModelConfig(model="tiny"), CacheConfig(block_size=16), max_num_tokens=256, max_num_seqs=4)
    shape = runner.loaded.shape
    # Every sequence at full context: 4 sequences x 2048 tokens / 16 per block.
    assert runner.num_blocks == 4 * 2048 // 16
    assert runner.block_size == 16 and runner.device == torch.device("cpu")
    assert len(runner.kv_caches) == shape.num_layers
    k, v = runner.kv_caches[0]
    # The CPU backend's head-major layout: one [num_slots, head_dim] matrix per KV head.
    assert k.shape == v.shape == (shape.num_kv_heads, runner.num_blocks, 16, shape.head_dim)
    assert ModelRunner(ModelConfig(model="tiny", attention_backend="torch"), CacheConfig(block_size=16),
                       max_num_tokens=256, max_num_seqs=4).kv_caches[0][0].shape == (512, 16, 2, 16)
    assert k.dtype == torch.float32 and not k.any()
    assert runner.kv_bytes_per_block == 16 * shape.kv_bytes_per_token(4)


def test_cpu_kv_cache_is_capped_and_too_small_a_cache_is_refused(monkeypatch):
    monkeypatch.setattr(model_runner, "CPU_KV_CACHE_BYTES", 300 * 8192)  # 300 tiny blocks of 8 KiB
    runner = ModelRunner(ModelConfig(model="tiny"), CacheConfig(block_size=16), max_num_tokens=64, max_num_seqs=64)
    assert runner.num_blocks == 300
    monkeypatch.setattr(model_runner, "CPU_KV_CACHE_BYTES", 100 * 8192)  # fewer than one 2048-token sequence
    with pytest.raises(ValueError, match="fits only 100 blocks .* give --num-kv-blocks"):
        ModelRunner(ModelConfig(model="tiny"), CacheConfig(block_size=16), max_num_tokens=64, max_num_seqs=64)
    with pytest.raises(ValueError, match="kv_memory_fraction must be in"):
        ModelRunner(ModelConfig(model="tiny"), CacheConfig(kv_memory_fraction=1.5), max_num_tokens=64, max_num_seqs=4)


def test_prepare_inputs_builds_the_ragged_batch():
    runner = tiny_runner(num_blocks=32, block_size=16)
    dec = make_request("dec", list(range(100, 120)), [7, 3])
    dec.append_output_token(400)  # decoding its 21st token, at position 20
    part = make_request("part", list(range(200, 240)), [2, 9, 30])
    recompute = make_request("re", list(range(300, 310)), [11])
    for token in (1, 2, 3):  # preempted, now prefilled again with its outputs
        recompute.append_output_token(token)
    output = SchedulerOutput(chunks=[
        ScheduledChunk(dec, 20, 1, is_prefill=False, samples=True),
        ScheduledChunk(part, 5, 13, is_prefill=True, samples=False),  # crosses from block 2 into block 9
        ScheduledChunk(recompute, 8, 5, is_prefill=True, samples=True),
    ])
    inputs = runner.prepare_inputs(output)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == [400] + list(range(205, 218)) + [308, 309, 1, 2, 3]
    assert inputs.positions.tolist() == [20] + list(range(5, 18)) + list(range(8, 13))
    assert md.slot_mapping.tolist() == ([3 * 16 + 4] + [2 * 16 + p for p in range(5, 16)] + [9 * 16, 9 * 16 + 1]
                                        + [11 * 16 + p for p in range(8, 13)])
    assert md.query_start_loc.tolist() == [0, 1, 14, 19]
    assert md.seq_lens.tolist() == [21, 18, 13] and md.seq_lens_host == [21, 18, 13]
    assert md.query_lens_host == [1, 13, 5]
    assert md.block_tables.tolist() == [[7, 3], [2, 9], [11, 0]]  # only the blocks each sequence reaches
    assert md.block_tables.dtype == torch.int32 and md.slot_mapping.dtype == torch.int64
    assert (md.max_query_len, md.max_seq_len, md.block_size) == (13, 21, 16)
    assert inputs.logits_indices.tolist() == [0, 18]  # the partial prefill samples nothing
    assert not inputs.is_decode_only
    decode_only = runner.prepare_inputs(SchedulerOutput(chunks=[ScheduledChunk(dec, 20, 1, False, True)]))
    assert decode_only.is_decode_only


def test_mixed_batch_logits_come_in_chunk_order_and_match_solo_runs():
    runner = tiny_runner(num_blocks=32, block_size=16)
    prompts = {"a": list(range(1, 12)), "b": list(range(50, 80)), "c": list(range(90, 115)), "d": list(range(7, 10))}
    blocks = {"a": [0], "b": [1, 2], "c": [3, 4], "d": [5]}
    # Solo references: each request alone, prefilled in one chunk.
    solo = {k: prefill_all_rows(runner, make_request(k, p, [20 + i, 25 + i]), len(p))
            for i, (k, p) in enumerate(prompts.items())}
    reqs = {k: make_request(k, p, blocks[k]) for k, p in prompts.items()}
    # a and d have their prompts but the last token cached; b is new; c is a partial prefill.
    for k in ("a", "d"):
        step(runner, [ScheduledChunk(reqs[k], 0, len(prompts[k]) - 1, True, False)])
    logits = step(runner, [
        ScheduledChunk(reqs["a"], 10, 1, True, True),
        ScheduledChunk(reqs["b"], 0, 30, True, True),
        ScheduledChunk(reqs["c"], 0, 16, True, False),
        ScheduledChunk(reqs["d"], 2, 1, True, True),
    ])
    assert logits.shape == (3, runner.loaded.shape.vocab_size)
    for row, k in enumerate(("a", "b", "d")):
        torch.testing.assert_close(logits[row], solo[k][-1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits[0], logits[2])


def test_bad_iterations_are_refused_with_clear_errors():
    runner = ModelRunner(ModelConfig(model="tiny", max_model_len=64), CacheConfig(block_size=16, num_blocks=16),
                         max_num_tokens=32, max_num_seqs=4)
    with pytest.raises(ValueError, match="at least one scheduled chunk"):
        runner.execute_model(SchedulerOutput())
    big = make_request("big", list(range(40)), [0, 1, 2])
    with pytest.raises(ValueError, match="40 tokens scheduled, more than max_num_tokens 32"):
        runner.execute_model(SchedulerOutput(chunks=[ScheduledChunk(big, 0, 40, True, True)]))
    short = make_request("short", list(range(20)), [4])
    with pytest.raises(ValueError, match="request short reaches position 20: .* its 1 KV blocks"):
        runner.execute_model(SchedulerOutput(chunks=[ScheduledChunk(short, 0, 20, True, True)]))
    long = make_request("long", list(range(70)), list(range(5)))
    with pytest.raises(ValueError, match="past max_model_len 64"):
        runner.execute_model(SchedulerOutput(chunks=[ScheduledChunk(long, 50, 20, True, True)]))
    with pytest.raises(ValueError, match="max_num_tokens and max_num_seqs must be positive"):
        ModelRunner(ModelConfig(model="tiny"), CacheConfig(num_blocks=4), max_num_tokens=0, max_num_seqs=4)


def test_staging_buffers_give_the_same_inputs_and_logits():
    """The CUDA path's packed host buffers (unpinned here) fill exactly what fresh host tensors hold."""
    plain = tiny_runner(num_blocks=32)
    staged = tiny_runner(num_blocks=32)
    staged._staging = staged.allocate_staging_buffers(pin_memory=False)
    results = []
    for runner in (plain, staged):
        req = make_request("a", list(range(3, 40)), [4, 1, 9])
        rows = prefill_all_rows(runner, req, chunk_size=11)
        req.append_output_token(int(rows[-1].argmax()))
        results.append((rows, step(runner, [ScheduledChunk(req, 37, 1, False, True)])))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    # An iteration bigger than the buffers bypasses them.
    staged._staging = {dtype: buf[:4] for dtype, buf in staged._staging.items()}
    big = make_request("b", list(range(3, 40)), [4, 1, 9])
    torch.testing.assert_close(prefill_all_rows(staged, big, chunk_size=37), prefill_all_rows(plain, big, 37))
