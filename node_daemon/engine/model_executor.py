"""The real-model Executor: the model runner's logits, sampled per request (engine_protocol.Executor).

Constrained rows (a request with a grammar matcher): their masks are asked of the MaskFiller before the forward
and computed beside it, applied to those rows only just before sampling, and each sampled token is accepted by its
matcher; a row whose mask is not ready soon after the logits sits the step out (MASK_WAIT_S). A batch with no
constrained row pays nothing.
"""
from __future__ import annotations

from concurrent import futures
from concurrent.futures import Future

import torch

from stallfree.node_daemon.engine.config import EngineConfig
from stallfree.node_daemon.engine.draft_verifier import verify_draft
from stallfree.node_daemon.engine.engine_protocol import ExecutorOutput
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.models.loader import LoadedModel
from stallfree.node_daemon.engine.sampler import Sampler
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from stallfree.node_daemon.structured import grammar_work
from stallfree.node_daemon.structured.masks import MaskFiller, StepMasks, apply_masks


# How long the other rows of a step wait, once the logits are back, for a constrained row's mask still being computed
# (it had the whole forward already): past it that row sits the step out, its newest token computed again in the
# next step, rather than stall every stream (a 7,000-property schema's mask took over 100 ms in some states).
MASK_WAIT_S = 0.005
# A mask slower than this, computed on the other core, would stretch the forward beside it: the next step leaves
# the mask worker a core (a 7,000-property schema's first mask took 120 ms; a small schema's, well under 1 ms).
SLOW_MASK_S = 0.005
# A GPU's decode stays bound by reading the weights up to tens of rows for the models served here; an estimate, not
# measured on this project's GPUs yet.
GPU_SPECULATION_ROWS = 64


class ModelExecutor:
    """Runs one iteration on the model and returns the sampled token of every chunk that samples."""

    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler(runner.device)
        self._mask_filler: MaskFiller | None = None  # made at the first constrained row
        self._threads_before_grammar_work: int | None = None  # torch's threads while one is left to grammar work

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
        """Sampled tokens by request id, with the logprobs of the rows that asked, the grammars' dead ends, the
        verifications' kept drafts, and the constrained rows that sat this step out (their mask was not ready)."""
        plain: list[tuple[int, ScheduledChunk]] = []  # (logits row, chunk) of each row sampled on its own
        verifications: list[tuple[int, ScheduledChunk]] = []  # (first logits row, chunk)
        num_rows = 0
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            if chunk.draft:
                verifications.append((num_rows, chunk))
                num_rows += chunk.num_tokens
            else:
                plain.append((num_rows, chunk))
                num_rows += 1
        constrained = [chunk for _, chunk in plain if chunk.request.matcher is not None]
        self._leave_a_core_to_grammar_work(constrained)
        pending = self._masks(constrained[0].request.matcher.vocab_size).masks_for(
            [(chunk.request.request_id, chunk.request.matcher) for chunk in constrained]) if constrained else []
        logits = self.runner.execute_model(output)  # the masks are computed meanwhile
        if not num_rows:
            return ExecutorOutput({})
        masks, deferred = self._ready_masks(constrained, pending, alone=len(constrained) == len(output.chunks))
        if deferred:
            plain = [(row, chunk) for row, chunk in plain if chunk.request.request_id not in deferred]
        result = self._sample_plain(logits, plain, num_rows, masks)
        result.deferred = deferred
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

    def _leave_a_core_to_grammar_work(self, constrained: list[ScheduledChunk]) -> None:
        """While a request's grammar is checked or compiled (structured/grammar_work.py), a constrained row's last
        mask was slow (SLOW_MASK_S), or a mask a step went on without is still computed, the CPU forward runs one
        thread fewer: the work gets a core of its own instead of stretching every step (a barrier waits for the
        thread that shares its core), and no thread of the process runs at a lower priority holding up the GIL.
        Masks that keep up with the steps never trigger it."""
        if self.runner.device.type != "cpu":
            return
        filler = self._mask_filler
        busy = (grammar_work.busy() or any(chunk.request.matcher.last_mask_s > SLOW_MASK_S for chunk in constrained)
                or (filler is not None and filler.late()))
        before = self._threads_before_grammar_work
        if busy and before is None:
            threads = torch.get_num_threads()
            if threads > 1:
                self._threads_before_grammar_work = threads
                torch.set_num_threads(threads - 1)
        elif not busy and before is not None:
            torch.set_num_threads(before)
            self._threads_before_grammar_work = None
        grammar_work.engine_stepping(core_left=self._threads_before_grammar_work is not None
                                     or torch.get_num_threads() == 1)

    def _ready_masks(self, constrained: list[ScheduledChunk], pending: list[Future[StepMasks]],
                     alone: bool) -> tuple[dict[str, StepMasks], set[str]]:
        """The constrained rows' masks that are ready (by request id), and the rows whose mask is not: the others
        wait MASK_WAIT_S for it, unless nothing else is in the step (then every mask is waited for)."""
        if not pending:
            return {}, set()
        futures.wait(pending, timeout=None if alone else MASK_WAIT_S)
        ready: dict[str, StepMasks] = {}
        deferred: set[str] = set()
        filler = self._mask_filler
        for chunk, future in zip(constrained, pending):
            rid = chunk.request.request_id
            if not future.done():
                deferred.add(rid)
                filler.mark_late(future)
                continue
            ready[rid] = future.result()
            filler.taken(rid, chunk.request.matcher)
        return ready, deferred

    def _sample_plain(self, logits: torch.Tensor, plain: list[tuple[int, ScheduledChunk]], num_rows: int,
                      masks: dict[str, StepMasks]) -> ExecutorOutput:
        """Sample the rows that are not verifications, each constrained one under its mask, its token accepted by
        its grammar (a dead end where the mask allows nothing or the grammar refuses the token)."""
        if not plain:
            return ExecutorOutput({})
        requests = [chunk.request for _, chunk in plain]
        request_ids = [request.request_id for request in requests]
        params = [request.sampling for request in requests]
        with torch.inference_mode():  # the runner's logits are inference tensors
            if len(plain) != num_rows:  # some rows are verifications or sat out: the sampled ones alone
                logits = logits.index_select(0, torch.tensor([row for row, _ in plain], dtype=torch.long,
                                                             device=logits.device))
            positions = [i for i, rid in enumerate(request_ids) if rid in masks]
            dead_ends: set[str] = set()
            if positions:
                step = StepMasks(torch.cat([masks[request_ids[i]].bias for i in positions]),
                                 [n for n, i in enumerate(positions) if masks[request_ids[i]].dead])
                apply_masks(logits, positions, step)
                for n in step.dead:  # nothing allowed: sample from harmless logits, the token is dropped
                    logits[positions[n]].zero_()
                    dead_ends.add(request_ids[positions[n]])
        result = self._sample(logits, params, request_ids, requests)
        for i in positions:
            rid = request_ids[i]
            if rid not in dead_ends and not requests[i].matcher.accept(result.token_ids[rid]):
                dead_ends.add(rid)
        for rid in dead_ends:
            del result.token_ids[rid]
            result.logprobs.pop(rid, None)
        result.dead_ends = dead_ends
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
        """The request is gone: drop its sampling state (its seeded generator) and its pending masks."""
        self.sampler.free(request_id)
        if self._mask_filler is not None:
            self._mask_filler.forget(request_id)
