"""Shared by the model tests: requests with hand-placed KV blocks, chunked prefills, a cached SmolLM2 runner."""
from __future__ import annotations

import contextlib

import functools

import torch

from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.engine.request import Request
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput

# The test machine's cores are shared: OpenMP threads spin-waiting on a busy core make every op many times
# slower, while one thread is steady. Model tests are small enough for one.
torch.set_num_threads(1)


# About 40 SmolLM2 tokens of plain English prose.
ENGLISH_PASSAGE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
                   "combined movable metal type with an oil-based ink and a wooden screw press, so that books "
                   "could be copied faster and more cheaply than")


def tiny_runner(num_blocks: int = 96, block_size: int = 16, **model_kwargs) -> ModelRunner:
    return ModelRunner(ModelConfig(model="tiny", **model_kwargs), CacheConfig(block_size=block_size, num_blocks=num_blocks),
                       max_num_tokens=1024, max_num_seqs=16)


@functools.lru_cache(maxsize=None)
def smollm2_runner() -> ModelRunner:
    """Loaded once per test session (a few seconds on the CPU); tests use disjoint block ids."""
    return ModelRunner(ModelConfig(model="smollm2-135m"), CacheConfig(block_size=16, num_blocks=64),
                       max_num_tokens=512, max_num_seqs=8)


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_runner().loaded)


def make_request(request_id: str, prompt: list[int], block_ids: list[int]) -> Request:
    req = Request(request_id, prompt, SamplingParams(max_tokens=64))
    req.block_ids = list(block_ids)
    return req


def step(runner: ModelRunner, chunks: list[ScheduledChunk], all_logits: bool = False) -> torch.Tensor:
    return runner.execute_model(SchedulerOutput(chunks=chunks), all_logits=all_logits)


def prefill_all_rows(runner: ModelRunner, req: Request, chunk_size: int, start: int = 0) -> torch.Tensor:
    """Prefill req's tokens from `start` in chunks of `chunk_size`; logits of every computed row, stacked."""
    rows = []
    end = req.num_tokens
    pos = start
    while pos < end:
        n = min(chunk_size, end - pos)
        chunk = ScheduledChunk(req, pos, n, is_prefill=True, samples=pos + n == end)
        rows.append(step(runner, [chunk], all_logits=True))
        pos += n
    req.num_computed_tokens = end
    return torch.cat(rows)


def greedy_decode(runner: ModelRunner, req: Request, last_logits: torch.Tensor, steps: int) -> list[int]:
    """Append `steps` greedy tokens, one decode iteration each; returns them."""
    logits = last_logits
    for _ in range(steps):
        req.append_output_token(int(logits.argmax()))
        pos = req.num_tokens - 1
        logits = step(runner, [ScheduledChunk(req, pos, 1, is_prefill=False, samples=True)])[0]
        req.num_computed_tokens = req.num_tokens
    return req.token_ids[-steps:]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def needs_onednn_bf16():
    """Skip where this run's CPU tier has no oneDNN bfloat16 GEMM (below AVX-512: its projections are served from
    their GGUF codes instead, models/cpu_tier.py)."""
    import pytest

    from stallfree.node_daemon.models.cpu_tier import cpu_tier

    tier = cpu_tier()
    return pytest.mark.skipif(not tier.onednn_bf16, reason=f"CPU tier {tier.name}: oneDNN runs bfloat16 GEMMs only "
                                                           "with avx512bw, avx512vl and avx512dq")


@contextlib.contextmanager
def forced_cpu_tier(name: str):
    """This process's CPU tier forced to `name` (STALLFREE_CPU_TIER) for the block, as a daemon started with it
    would be, then the CPU's own again; the compiled extension's state is set aside and restored around it."""
    import os

    from stallfree.node_daemon.models import cpu_decode, cpu_tier

    saved_env, saved_state = os.environ.get(cpu_tier.ENV), dict(cpu_decode._state)
    os.environ[cpu_tier.ENV] = name
    cpu_tier.cpu_tier.cache_clear()
    cpu_decode._state.update(loaded=False, why=None, thread=None, child=None)
    try:
        yield cpu_tier.cpu_tier()
    finally:
        if saved_env is None:
            os.environ.pop(cpu_tier.ENV, None)
        else:
            os.environ[cpu_tier.ENV] = saved_env
        cpu_tier.cpu_tier.cache_clear()
        cpu_decode._state.update(saved_state)
