"""Drive a Scheduler the way the engine does, with synthetic sampled tokens, and check its invariants.

The scheduler is pure, so this is its real workload. `ShadowKV` stands in for the KV tensors: it
records which token each slot holds (written after each step, as the model would), and checks before
each step that every position a chunk attends to holds that request's own token, which is what a
correct block table and prefix cache guarantee.
"""
from __future__ import annotations

import weakref
import zlib

from stallfree.contracts import Ceilings, Tuning
from stallfree.node_daemon.engine.config import SchedulerConfig
from stallfree.node_daemon.engine.kv_cache_manager import KVCacheManager
from stallfree.node_daemon.engine.request import Request, RequestStatus
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.scheduler import Scheduler
from stallfree.node_daemon.engine.scheduler_output import SchedulerOutput
from stallfree.simulator.baseline_schedulers import PolicyConfig, build_scheduler

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, token_budget: int = 64, max_num_seqs: int = 8,
                   max_partial_prefills: int = 1, long_prefill_threshold: int = 0, max_model_len: int = 256,
                   prefix_caching: bool = True, watermark_blocks: int = 0, ceilings: Ceilings | None = None,
                   **kwargs) -> Scheduler:
    """The daemon's scheduler; `make_baseline` for the simulator's policies."""
    config = _config(SchedulerConfig, token_budget, max_num_seqs, max_partial_prefills, long_prefill_threshold,
                     max_model_len, watermark_blocks, ceilings)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_caching), **kwargs)


def make_baseline(policy: str = "stall_free", num_blocks: int = 64, block_size: int = 4, token_budget: int = 64,
                  max_num_seqs: int = 8, max_model_len: int = 256, iteration_time_target_ms: float | None = None,
                  cost_model=None) -> Scheduler:
    """One of the simulator's baseline schedulers (simulator/baseline_schedulers.py), as VirtualReplica builds it."""
    config = _config(PolicyConfig, token_budget, max_num_seqs, 1, 0, max_model_len, 0, None,
                     policy=policy, iteration_time_target_ms=iteration_time_target_ms)
    return build_scheduler(config, KVCacheManager(num_blocks, block_size, True), cost_model)


def _config(kind, token_budget, max_num_seqs, max_partial_prefills, long_prefill_threshold,
            max_model_len, watermark_blocks, ceilings, **extra):
    ceilings = ceilings or Ceilings(max_token_budget=max(256, token_budget), max_num_seqs=max(16, max_num_seqs))
    tuning = Tuning(token_budget=token_budget, max_num_seqs=max_num_seqs, max_partial_prefills=max_partial_prefills,
                    long_prefill_threshold=long_prefill_threshold)
    return kind(ceilings=ceilings, tuning=tuning, max_model_len=max_model_len, watermark_blocks=watermark_blocks,
                **extra)


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int = 4, ignore_eos: bool = True,
                 stop_token_ids: list[int] | None = None) -> Request:
    if isinstance(prompt, int):
        seed = zlib.crc32(request_id.encode())
        prompt = [10 + (seed + 7 * i) % 50 for i in range(prompt)]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids or [])
    return Request(request_id, prompt, sampling, eos_token_ids=(EOS,), arrival_time=0.0)


class ShadowKV:
    """Which token each KV slot holds, as the model runner would have written it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}

    def slot(self, request: Request, position: int) -> int:
        return request.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def check_and_write(self, output: SchedulerOutput) -> None:
        for chunk in output.chunks:
            request = chunk.request
            tokens = request.token_ids
            end = chunk.start + chunk.num_tokens
            assert end <= len(tokens) + len(chunk.draft), "a chunk runs past the request's tokens (and its draft)"
            assert len(request.block_ids) * self.block_size >= end, "block table too short for the chunk"
            for position in range(chunk.start):
                assert self.slots.get(self.slot(request, position)) == tokens[position], (
                    f"{request.request_id} position {position} reads another token's KV"
                )
        for chunk in output.chunks:  # the model writes after every read of the step is planned
            request = chunk.request
            tokens = request.token_ids + list(chunk.draft)  # a verification writes its draft's KV too
            for position in range(chunk.start, chunk.start + chunk.num_tokens):
                self.slots[self.slot(request, position)] = tokens[position]


def sample_tokens(output: SchedulerOutput, token_of) -> dict[str, int]:
    """Synthetic sampling: token_of(request) -> the next token id."""
    return {chunk.request.request_id: token_of(chunk.request) for chunk in output.chunks if chunk.samples}


def check_blocks_conserved(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache
    pool = kv.pool
    assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
    refs: dict[int, int] = {}
    for request in scheduler.running:
        assert len(set(request.block_ids)) == len(request.block_ids), "a block twice in one block table"
        for block_id in request.block_ids:
            refs[block_id] = refs.get(block_id, 0) + 1
    for request in scheduler.waiting:
        assert not request.block_ids, "a waiting request holds KV blocks"
    for block in pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), f"block {block.block_id} ref count drifted"
        assert pool.is_free(block.block_id) == (block.ref_cnt == 0)
    assert kv.num_used_blocks == len(refs)
    # The prefix-cache index and the blocks agree both ways (eviction relies on it).
    hashed = [block for block in pool.blocks if block.block_hash is not None]
    assert len(hashed) == pool.num_cached_blocks
    for block in hashed:
        assert pool.get_cached_block(block.block_hash) == block.block_id


_SHADOWS: "weakref.WeakKeyDictionary[Scheduler, ShadowKV]" = weakref.WeakKeyDictionary()


def shadow_for(scheduler: Scheduler) -> ShadowKV:
    """The one ShadowKV of a scheduler, so every step of a test is checked against the same slots."""
    if scheduler not in _SHADOWS:
        _SHADOWS[scheduler] = ShadowKV(scheduler.kv_cache.block_size)
    return _SHADOWS[scheduler]


def checked_step(scheduler: Scheduler, token_of=lambda request: 7,
                 now: float | None = None, accept_of=None) -> tuple[SchedulerOutput, list[Request]]:
    """One engine iteration (at `now`, as the engine's clock gives it): schedule, check and write the shadow KV,
    sample, update, check the blocks. `accept_of(request, draft)`: how many of a verification's draft tokens the
    synthetic model accepts (speculation; none when not given)."""
    output = scheduler.schedule(now)
    shadow_for(scheduler).check_and_write(output)
    accepted = ({c.request.request_id: accept_of(c.request, c.draft) for c in output.chunks if c.draft}
                if accept_of is not None else None)
    finished = scheduler.update_from_output(output, sample_tokens(output, token_of), accepted=accepted)
    check_blocks_conserved(scheduler)
    return output, finished


def run_to_completion(scheduler: Scheduler, token_of=lambda request: 7, max_steps: int = 10_000) -> list[Request]:
    """Step until nothing is left; returns the finished requests in finishing order."""
    finished: list[Request] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        finished += checked_step(scheduler, token_of)[1]
    raise AssertionError("the scheduler did not finish its requests: no progress")


def is_decode(request: Request) -> bool:
    running = request.status is RequestStatus.RUNNING
    return running and bool(request.output_token_ids) and request.num_tokens_to_compute == 1
