"""The real-model Executor: the model runner's logits, sampled per request (engine_protocol.Executor).

Constrained rows (a request with a grammar matcher): their masks are submitted to the MaskFiller before the
forward and computed beside it, applied to those rows only just before sampling, and each sampled token is
accepted by its matcher. A batch with no constrained row takes the plain path and pays nothing.
"""
from __future__ import annotations

import torch

from stallfree.node_daemon.engine.config import EngineConfig
from stallfree.node_daemon.engine.draft_verifier import verify_draft
from stallfree.node_daemon.engine.engine_protocol import ExecutorOutput
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.models.loader import LoadedModel
from stallfree.node_daemon.engine.sampler import Sampler
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.scheduler_output import SchedulerOutput
from stallfree.node_daemon.structured.masks import MaskFiller, apply_masks


# A GPU's decode stays bound by reading the weights up to tens of rows for the models served here; an estimate, not
# measured on this project's GPUs yet.
GPU_SPECULATION_ROWS = 64


class ModelExecutor:
    """Runs one iteration on the model and returns the sampled token of every chunk that samples."""

    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler(runner.device)
        self._mask_filler: MaskFiller | None = None  # made at the first constrained row

    supports_grammars = True  # its logits can be masked (the sim backend has none)

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

    supports_speculation = True  # its logits can verify drafts (engine/draft_verifier.py)

    @property
    def speculation_rows(self) -> int:
        """Rows an iteration may have with drafts in it (speculation.py max_rows): on the CPU, the rows up to which
        the quantized projections read each weight once for all rows (models/quantized.py CODE_MAX_ROWS; past it they
        turn compute-bound); on a GPU, GPU_SPECULATION_ROWS."""
        if self.runner.device.type == "cuda":
            return GPU_SPECULATION_ROWS
        from stallfree.node_daemon.models.quantized import CODE_MAX_ROWS

        return CODE_MAX_ROWS

    def execute(self, output: SchedulerOutput) -> ExecutorOutput:
        """Sampled tokens by request id, with the logprobs of the rows that asked (and the grammars' dead ends)."""
        if output.num_verify_tokens:
            return self._execute_with_drafts(output)
        params: list[SamplingParams] = []
        request_ids: list[str] = []
        requests = []
        constrained: list[int] = []  # rows whose request follows a grammar
        for chunk in output.chunks:
            if chunk.samples:
                request = chunk.request
                if request.matcher is not None:
                    constrained.append(len(requests))
                params.append(request.sampling)
                request_ids.append(request.request_id)
                requests.append(request)
        if not constrained:
            logits = self.runner.execute_model(output)
            if not request_ids:
                return ExecutorOutput({})
            return self._sample(logits, params, request_ids, requests)
        matchers = [requests[row].matcher for row in constrained]
        pending = self._masks(matchers[0].vocab_size).submit(matchers)  # computed while the forward runs
        try:
            logits = self.runner.execute_model(output)
        finally:
            masks = pending.result()  # the matchers are never touched while the worker reads them
        dead_ends = {request_ids[constrained[i]] for i in masks.dead}
        with torch.inference_mode():  # the runner's logits are inference tensors
            apply_masks(logits, constrained, masks)
            for i in masks.dead:  # nothing allowed: sample from harmless logits, the token is dropped
                logits[constrained[i]].zero_()
        result = self._sample(logits, params, request_ids, requests)
        for row, matcher in zip(constrained, matchers):
            rid = request_ids[row]
            if rid not in dead_ends and not matcher.accept(result.token_ids[rid]):
                dead_ends.add(rid)
        for rid in dead_ends:
            del result.token_ids[rid]
            result.logprobs.pop(rid, None)
        result.dead_ends = dead_ends
        return result

    def _execute_with_drafts(self, output: SchedulerOutput) -> ExecutorOutput:
        """An iteration with verifications (never of a constrained request: speculation.can_draft): the plain sampling
        rows go to the sampler together, each verification's rows to verify_draft."""
        logits = self.runner.execute_model(output)
        plain_rows: list[int] = []
        params: list[SamplingParams] = []
        request_ids: list[str] = []
        requests = []
        verifications = []  # (first row, chunk)
        row = 0
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            request = chunk.request
            if chunk.draft:
                verifications.append((row, chunk))
                row += chunk.num_tokens
                continue
            plain_rows.append(row)
            params.append(request.sampling)
            request_ids.append(request.request_id)
            requests.append(request)
            row += 1
        if request_ids:
            with torch.inference_mode():
                plain = logits.index_select(0, torch.tensor(plain_rows, dtype=torch.long, device=logits.device))
            result = self._sample(plain, params, request_ids, requests)
        else:
            result = ExecutorOutput({})
        for first, chunk in verifications:
            request = chunk.request
            rid = request.request_id
            verified = verify_draft(self.sampler, logits[first:first + chunk.num_tokens], request.sampling, rid,
                                    chunk.draft)
            result.token_ids[rid] = verified.token
            result.accepted[rid] = verified.num_accepted
            if verified.logprobs is not None:
                result.logprobs[rid] = verified.logprobs[-1]
                result.draft_logprobs[rid] = verified.logprobs[:-1]
        return result

    def _sample(self, logits, params: list[SamplingParams], request_ids: list[str], requests: list) -> ExecutorOutput:
        sampled = self.sampler.sample_rows(logits, params, request_ids, requests)
        tokens = dict(zip(request_ids, sampled.token_ids))
        if sampled.logprobs is None:
            return ExecutorOutput(tokens)
        return ExecutorOutput(tokens, {rid: lp for rid, lp in zip(request_ids, sampled.logprobs) if lp is not None})

    def _masks(self, vocab_size: int) -> MaskFiller:
        """The one mask worker, as wide as the grammars' vocabulary (the compiler's: at least the logits')."""
        if self._mask_filler is None or self._mask_filler.vocab_size != vocab_size:
            self._mask_filler = MaskFiller(vocab_size)
        return self._mask_filler

    def free(self, request_id: str) -> None:
        """The request is gone: drop its sampling state (its seeded generator)."""
        self.sampler.free(request_id)
