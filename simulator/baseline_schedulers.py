"""The simulator's baseline scheduling policies: what stall-free batching is compared against.

Each is the daemon's Scheduler (same admission, KV reservation, preemption and bookkeeping) with another
iteration policy, so a comparison differs in the policy alone:
- prefill_priority (vLLM before chunking, Orca): when a waiting request fits, the iteration runs whole
  prompts only, FCFS, up to max(budget ceiling, max_model_len) tokens; running decodes pause for it.
- decode_priority (FasterTransformer's request-level batching, Sarathi-Serve's "decode-prioritizing"):
  an iteration is all-decode while anything runs; whole prompts are admitted only when nothing is
  running, as one batch under the same token limit.
- stall_free with an iteration time target: each prefill chunk is cut, by bisection on the cost model,
  to the largest size whose predicted iteration time fits the target.

The daemon serves none of them; `build_scheduler` is what VirtualReplica hands LLMEngine.
"""
from __future__ import annotations

from dataclasses import dataclass

from stallfree.contracts import Tuning
from stallfree.node_daemon.engine.config import SchedulerConfig
from stallfree.node_daemon.engine.kv_cache_manager import KVCacheManager
from stallfree.node_daemon.engine.scheduler import Scheduler
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from stallfree.node_daemon.sim.cost_model import IterationCostModel

POLICIES = ("stall_free", "prefill_priority", "decode_priority")


@dataclass
class PolicyConfig(SchedulerConfig):
    """SchedulerConfig plus the simulator's choice of policy."""

    policy: str = "stall_free"
    # When set (and a cost model is given), prefill chunks are cut so the predicted iteration time fits.
    iteration_time_target_ms: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; choose one of {', '.join(POLICIES)}")


def build_scheduler(config: SchedulerConfig, kv_cache: KVCacheManager,
                    cost_model: IterationCostModel | None = None) -> Scheduler:
    """The scheduler a config names: the daemon's for a plain SchedulerConfig, else the PolicyConfig's baseline."""
    policy = config.policy if isinstance(config, PolicyConfig) else "stall_free"
    if policy == "prefill_priority":
        return PrefillPriorityScheduler(config, kv_cache)
    if policy == "decode_priority":
        return DecodePriorityScheduler(config, kv_cache)
    target = config.iteration_time_target_ms if isinstance(config, PolicyConfig) else None
    if target is not None and cost_model is not None:
        return TimeTargetScheduler(config, kv_cache, cost_model, target)
    return Scheduler(config, kv_cache)


class _WholePrompts(Scheduler):
    def _schedule_whole_prompts(self, out: SchedulerOutput, tuning: Tuning) -> bool:
        """Admit whole prompts FCFS up to max(budget ceiling, max_model_len) tokens; True if any was."""
        limit = max(self.config.ceilings.max_token_budget, self.config.max_model_len)
        kv = self.kv_cache
        waiting = self.waiting
        num_tokens = 0
        while waiting and self.num_running < tuning.max_num_seqs:
            request = waiting[0]
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            n = request.num_tokens - num_hit_tokens
            if num_tokens + n > limit or not self._admit(request, hits, n):
                break
            out.chunks.append(ScheduledChunk(request, num_hit_tokens, n, True, True))
            num_tokens += n
        out.num_prefill_tokens = num_tokens
        return num_tokens > 0


class PrefillPriorityScheduler(_WholePrompts):
    def _schedule(self, out: SchedulerOutput, tuning: Tuning) -> None:
        # Not after a preemption in this iteration: KV is short, the victim would take back its own room.
        if out.preempted or not self._schedule_whole_prompts(out, tuning):
            self._schedule_decodes(out)


class DecodePriorityScheduler(_WholePrompts):
    def _schedule(self, out: SchedulerOutput, tuning: Tuning) -> None:
        if self.num_running:
            self._schedule_decodes(out)
        else:
            self._schedule_whole_prompts(out, tuning)


class TimeTargetScheduler(Scheduler):
    """Stall-free, with every prefill chunk also cut to the largest size whose predicted iteration fits `target_ms`."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, cost_model: IterationCostModel,
                 target_ms: float) -> None:
        super().__init__(config, kv_cache)
        self.cost_model = cost_model
        self.target_ms = target_ms

    def _chunk_size(self, remaining: int, budget: int, tuning: Tuning, prefix_len: int,
                    chunks: list[ScheduledChunk]) -> int:
        n = super()._chunk_size(remaining, budget, tuning, prefix_len, chunks)
        return self._fit_time_target(n, chunks, prefix_len) if n > 0 else n

    def _fit_time_target(self, limit: int, chunks: list[ScheduledChunk], prefix_len: int) -> int:
        """Largest chunk up to `limit` whose predicted iteration fits the target (bisection).

        An iteration that would otherwise be empty takes at least one token, so a target below the
        fixed overhead slows prefill down but never stops it.
        """
        decode_lens = [c.start + 1 for c in chunks if not c.is_prefill]
        prefill_chunks = [(c.start, c.num_tokens) for c in chunks if c.is_prefill]
        predict, target = self.cost_model.predict_ms, self.target_ms
        if predict(decode_lens, prefill_chunks + [(prefix_len, limit)]) <= target:
            return limit
        lo, hi = 0, limit  # lo fits (0: nothing), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if predict(decode_lens, prefill_chunks + [(prefix_len, mid)]) <= target:
                lo = mid
            else:
                hi = mid
        if lo == 0 and not chunks:
            return 1
        return lo
