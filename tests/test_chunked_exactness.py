"""Chunked prefill is exact: any chunking (blocks split unevenly, chunks over a cached prefix, chunks
sharing an iteration with decodes) gives the unchunked prefill's logits within 1e-4 relative in float32,
and the same greedy continuation. For the tiny random model and for the embedded SmolLM2."""
from __future__ import annotations

import random

import pytest
import torch

from model_helpers import (ENGLISH_PASSAGE, greedy_decode, make_request, prefill_all_rows, relative_error,
                           smollm2_runner, smollm2_tokenizer, step, tiny_runner)
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk

TOLERANCE = 1e-4
DECODE_STEPS = 4


def _blocks(rng: random.Random, pool: list[int], n: int) -> list[int]:
    """n distinct physical blocks taken from the pool in shuffled order (block tables are not contiguous)."""
    picked = rng.sample(pool, n)
    for b in picked:
        pool.remove(b)
    return picked


def _check_chunkings(runner, prompt: list[int], chunk_sizes: list[int], blocks_per_request: int) -> None:
    rng = random.Random(0)
    pool = list(range(runner.num_blocks))
    ref_req = make_request("ref", prompt, _blocks(rng, pool, blocks_per_request))
    ref = prefill_all_rows(runner, ref_req, chunk_size=len(prompt))
    ref_tokens = greedy_decode(runner, ref_req, ref[-1], DECODE_STEPS)
    for size in chunk_sizes:
        req = make_request(f"chunk{size}", prompt, _blocks(rng, pool, blocks_per_request))
        got = prefill_all_rows(runner, req, chunk_size=size)
        assert got.shape == ref.shape
        assert relative_error(got, ref) <= TOLERANCE, f"chunk size {size}"
        assert greedy_decode(runner, req, got[-1], DECODE_STEPS) == ref_tokens, f"chunk size {size}"


def test_tiny_model_chunk_sizes_split_blocks_unevenly():
    runner = tiny_runner(num_blocks=96, block_size=16)
    prompt = [random.Random(1).randrange(runner.loaded.shape.vocab_size) for _ in range(77)]
    _check_chunkings(runner, prompt, [1, 5, 7, 16, 23, 40, 76], blocks_per_request=6)


def test_tiny_model_odd_block_size():
    runner = tiny_runner(num_blocks=200, block_size=5)
    prompt = [random.Random(2).randrange(runner.loaded.shape.vocab_size) for _ in range(53)]
    _check_chunkings(runner, prompt, [3, 8, 13], blocks_per_request=13)


def test_tiny_model_chunk_over_cached_prefix():
    """Request B shares A's first two full blocks (a prefix-cache hit) and prefills only its own suffix."""
    runner = tiny_runner(num_blocks=64, block_size=16)
    rng = random.Random(3)
    vocab = runner.loaded.shape.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(32)]
    prompt_a = prefix + [rng.randrange(vocab) for _ in range(10)]
    prompt_b = prefix + [rng.randrange(vocab) for _ in range(29)]
    a = make_request("a", prompt_a, [40, 7, 21])
    prefill_all_rows(runner, a, chunk_size=len(prompt_a))
    ref_b = prefill_all_rows(runner, make_request("b-ref", prompt_b, [3, 11, 30, 5]), chunk_size=len(prompt_b))
    for i, size in enumerate((6, 16, 29)):
        b = make_request(f"b{size}", prompt_b, [40, 7, 50 + i, 55 + i])  # cached blocks 40, 7, then its own
        got = prefill_all_rows(runner, b, chunk_size=size, start=32)
        assert relative_error(got, ref_b[32:]) <= TOLERANCE, f"chunk size {size}"


def test_tiny_model_chunks_share_iterations_with_decodes():
    """A chunked prompt scheduled beside a running decode: neither disturbs the other."""
    runner = tiny_runner(num_blocks=64, block_size=16)
    rng = random.Random(4)
    vocab = runner.loaded.shape.vocab_size
    long_prompt = [rng.randrange(vocab) for _ in range(45)]
    short_prompt = [rng.randrange(vocab) for _ in range(9)]
    ref_long = prefill_all_rows(runner, make_request("ref-long", long_prompt, [0, 1, 2]), chunk_size=45)

    # The decoding stream's reference: prefill then greedy decodes alone.
    solo = make_request("solo", short_prompt, [3, 4])
    solo_tokens = greedy_decode(runner, solo, prefill_all_rows(runner, solo, 9)[-1], 3)

    decoder = make_request("dec", short_prompt, [5, 6])
    last = prefill_all_rows(runner, decoder, 9)[-1]
    decoder.append_output_token(int(last.argmax()))
    long_req = make_request("long", long_prompt, [9, 13, 8])
    rows, got_tokens = [], [decoder.output_token_ids[-1]]
    for start in (0, 16, 32):  # three iterations: one decode + a 16/16/13-token chunk each
        n = min(16, 45 - start)
        chunks = [ScheduledChunk(decoder, decoder.num_tokens - 1, 1, False, True),
                  ScheduledChunk(long_req, start, n, True, start + n == 45)]
        logits = step(runner, chunks, all_logits=True)
        rows.append(logits[1:])
        if len(got_tokens) < 3:
            decoder.append_output_token(int(logits[0].argmax()))
            got_tokens.append(decoder.output_token_ids[-1])
    assert relative_error(torch.cat(rows), ref_long) <= TOLERANCE
    assert got_tokens == solo_tokens


@pytest.fixture(scope="module")
def smollm2_prompt() -> list[int]:
    runner = smollm2_runner()
    ids = smollm2_tokenizer().encode(ENGLISH_PASSAGE)
    assert 30 <= len(ids) <= 48
    return ids


def test_smollm2_chunked_prefill_matches_unchunked(smollm2_prompt):
    runner = smollm2_runner()
    _check_chunkings(runner, smollm2_prompt, [7, 16, 25], blocks_per_request=4)
