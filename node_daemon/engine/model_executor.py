"""The real-model Executor: the model runner's logits, sampled per request (engine_protocol.Executor)."""
from __future__ import annotations

from stallfree.node_daemon.engine.config import EngineConfig
from stallfree.node_daemon.engine.engine_protocol import ExecutorOutput
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.models.loader import LoadedModel
from stallfree.node_daemon.engine.sampler import Sampler
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.scheduler_output import SchedulerOutput


class ModelExecutor:
    """Runs one iteration on the model and returns the sampled token of every chunk that samples."""

    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler(runner.device)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "ModelExecutor":
        """Load the model and size its buffers for the ceilings (the live budget never exceeds them)."""
        ceilings = config.scheduler.ceilings
        runner = ModelRunner(config.model, config.cache, max_num_tokens=ceilings.max_token_budget,
                             max_num_seqs=ceilings.max_num_seqs)
        return cls(runner)

    @property
    def loaded(self) -> LoadedModel:
        return self.runner.loaded

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.loaded.shape.vocab_size

    def execute(self, output: SchedulerOutput) -> ExecutorOutput:
        """Sampled tokens by request id, with the logprobs of the rows that asked."""
        logits = self.runner.execute_model(output)
        params: list[SamplingParams] = []
        request_ids: list[str] = []
        requests = []
        for chunk in output.chunks:
            if chunk.samples:
                params.append(chunk.request.sampling)
                request_ids.append(chunk.request.request_id)
                requests.append(chunk.request)
        if not request_ids:
            return ExecutorOutput({})
        sampled = self.sampler.sample_rows(logits, params, request_ids, requests)
        tokens = dict(zip(request_ids, sampled.token_ids))
        if sampled.logprobs is None:
            return ExecutorOutput(tokens)
        return ExecutorOutput(tokens, {rid: lp for rid, lp in zip(request_ids, sampled.logprobs) if lp is not None})

    def free(self, request_id: str) -> None:
        """The request is gone: drop its sampling state (its seeded generator)."""
        self.sampler.free(request_id)
