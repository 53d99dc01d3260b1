"""LLMEngine: the synchronous engine loop, one `step()` per iteration.

    add_request -> Scheduler.schedule -> Executor.execute (model runner + sampler, or the sim)
                -> Scheduler.update_from_output -> detokenize, stop strings -> RequestOutput per request

The scheduler never reads a clock; this file stamps every request time (first scheduled, first and last
token, finished) and tells the observer about each iteration, token and finish.

One request's fault is its own: when the batch fails to execute, each chunk runs alone once to find the
request(s) at fault, and an error detokenizing one request fails only that one. A failed request finishes
with finish_reason "error" and the message; the iteration goes on for the others.

A request is checked once, against engine/request_rules.py: here for direct callers, or by the server before
admission (then `checked=True`); the scheduler only asserts what those rules guarantee.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Callable, Sequence

from stallfree.contracts import Ceilings, Tuning
from stallfree.node_daemon.engine.config import EngineConfig, SchedulerConfig
from stallfree.node_daemon.text.detokenizer import IncrementalDetokenizer
from stallfree.node_daemon.engine.engine_protocol import (EngineObserver, Executor, ExecutorOutput, IterationRecord,
                                                          RequestOutput, TokenLogprob)
from stallfree.node_daemon.engine.kv_cache_manager import KVCacheManager
from stallfree.node_daemon.engine.request import Objective, Request, RequestStatus
from stallfree.node_daemon.engine.request_rules import (InvalidRequest, RequestLimits, check_prompt_tokens,
                                                        check_request)
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.scheduler import Scheduler
from stallfree.node_daemon.engine.scheduler_output import SchedulerOutput
from stallfree.node_daemon.engine.speculation import SpeculativeConfig
from stallfree.node_daemon.text.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:  # structured/ loads llguidance and torch; the sim backend never needs them
    from stallfree.node_daemon.structured.compiler import CompiledGrammar

log = logging.getLogger(__name__)

_STOPPED = RequestStatus.FINISHED_STOPPED
_DEAD_END = RequestStatus.FINISHED_GRAMMAR_DEAD_END
_GONE = object()  # a request's detokenizer slot after it finished or was aborted


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        tokenizer: Tokenizer | None = None,
        observer: EngineObserver | None = None,
        *,
        make_scheduler: Callable[[SchedulerConfig, KVCacheManager], Scheduler] = Scheduler,
        clock: Callable[[], float] = time.monotonic,
        detokenize: bool = True,
    ) -> None:
        """Without an executor, load the model named by config.model and size the KV cache from it.

        Another executor (the sim backend) brings its own `tokenizer`; the KV cache size and the context come
        from the executor's num_blocks / max_model_len unless they are None, else from the config.
        `detokenize=False` (the simulator: nobody reads the text) leaves the outputs' text empty unless a
        request has stop strings, which need it. `make_scheduler` is how the simulator runs its baseline
        policies (simulator/baseline_schedulers.py) in this same loop.
        """
        if executor is None:
            from stallfree.node_daemon.engine.model_executor import ModelExecutor

            executor = ModelExecutor.from_config(config)
        self.config = config
        self.executor = executor
        loaded = executor.loaded
        if tokenizer is None:
            if loaded is None:
                raise ValueError("an executor without a loaded model needs a tokenizer")
            tokenizer = load_tokenizer(loaded)
        self.tokenizer = tokenizer
        self.max_model_len: int = (executor.max_model_len or config.model.max_model_len
                                   or config.scheduler.max_model_len)
        self.vocab_size: int = executor.vocab_size or tokenizer.vocab_size
        num_blocks = executor.num_blocks or config.cache.num_blocks
        if num_blocks < 1:
            raise ValueError("the KV cache size is unknown: give config.cache.num_blocks")
        block_size = executor.block_size or config.cache.block_size
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        # What this engine can serve (request_rules.py): the server checks requests against it before admission.
        self.limits = RequestLimits(self.max_model_len, self.vocab_size, num_blocks, block_size)
        scheduler_config = dataclasses.replace(config.scheduler, max_model_len=self.max_model_len)
        self.scheduler = make_scheduler(scheduler_config, self.kv_cache)
        speculative = self.scheduler.speculative
        if not getattr(executor, "supports_speculation", False):  # no logits to verify drafts (the sim backend)
            self.scheduler.speculative = SpeculativeConfig()
        elif speculative.enabled and not speculative.max_rows:
            self.scheduler.speculative = dataclasses.replace(speculative, max_rows=executor.speculation_rows)
        model_eos = tuple(loaded.eos_token_ids) if loaded is not None else ()
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(model_eos + tuple(tokenizer.eos_token_ids)))
        self.observer = observer
        # An observer (metrics, stats) that raises must not fail requests: each fault is counted by hook, logged
        # once per hook and exception type, and handed to on_observer_error (the daemon's metrics count it).
        self.observer_errors: dict[str, int] = {}
        self._observer_faults_logged: set[tuple[str, type]] = set()
        self.on_observer_error: Callable[[str], None] | None = None
        self.clock = clock
        self._detokenizers: dict[str, IncrementalDetokenizer | None] = {}  # every unfinished request
        self._detokenize = detokenize
        self._free_executor_state = executor.free
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs
        self.num_iterations = 0
        self._num_evictions = 0  # the KV cache's eviction count at the last iteration record
        self.last_num_scheduled_tokens = 0  # of the last step (async_engine's stall watch weighs turns by it)

    # ---- requests ------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        arrival_time: float | None = None,
        checked: bool = False,
        grammar: CompiledGrammar | None = None,
        objective: Objective | None = None,
        prefix_cache: bool = True,
    ) -> None:
        """Queue a request; ValueError naming the problem (and nothing else changed) if it is bad. `checked`: the
        caller already applied request_rules to it (the server, before admission), so it is not checked again.
        `grammar`: the request's output must follow it (it gets a matcher of its own; n > 1 adds one request per
        choice, so each sequence has its own). `objective`: what the router signed for it (the scheduler's order).
        `prefix_cache` False: its blocks are neither looked up nor kept for later prompts (the start-up profile's
        random prompts: kept, they would stay resident and hold the LRU's back for nothing)."""
        sampling = sampling if sampling is not None else SamplingParams()
        if request_id in self._detokenizers:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise InvalidRequest("the prompt is empty: at least one token is needed")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt_token_ids)  # type: ignore[arg-type]
        if not checked:
            limits = self.limits
            check_prompt_tokens(token_ids, limits)
            check_request(len(token_ids), sampling, limits)
        if grammar is not None and not self.supports_grammars:
            raise ValueError("this backend computes no logits, so it cannot constrain the output to a grammar "
                             "(response_format json, forced tool calls): serve a real model")
        request = Request(request_id, token_ids, sampling, self.eos_token_ids,
                          arrival_time=self.clock() if arrival_time is None else arrival_time,
                          max_model_len=self.max_model_len,
                          matcher=grammar.new_matcher() if grammar is not None else None, objective=objective,
                          prefix_cache=prefix_cache)
        self.scheduler.add_request(request)
        self._detokenizers[request_id] = (IncrementalDetokenizer(self.tokenizer, token_ids, sampling.stop,
                                                                 skip_special_tokens=sampling.skip_special_tokens,
                                                                 include_stop=sampling.include_stop_str_in_output)
                                          if self._detokenize or sampling.stop else None)

    @property
    def supports_grammars(self) -> bool:
        """Whether the executor masks logits for constrained requests (the model does; the sim has no logits)."""
        return bool(getattr(self.executor, "supports_grammars", False))

    def abort_request(self, request_id: str) -> Request | None:
        """Abort at once: its KV blocks are free when this returns. None if unknown or already finished."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        self._release(request, self.clock())
        return request

    def abort_all(self) -> int:
        """Abort every unfinished request; returns how many there were."""
        request_ids = list(self._detokenizers)
        for request_id in request_ids:
            self.abort_request(request_id)
        return len(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pause_request(self, request_id: str, paused: bool) -> bool:
        """Pause (its decodes skipped, its KV kept) or resume a request; False if unknown or finished."""
        return self.scheduler.set_paused(request_id, paused)

    @property
    def num_paused(self) -> int:
        return self.scheduler.num_paused

    @property
    def num_unfinished(self) -> int:
        return len(self._detokenizers)

    # ---- live tuning ---------------------------------------------------------------------------------

    def get_tuning(self) -> Tuning:
        return self.scheduler.tuning

    def set_tuning(self, tuning: Tuning) -> None:
        """Raises contracts.TuningError; a valid tuning takes effect at the next step."""
        self.scheduler.set_tuning(tuning)

    @property
    def ceilings(self) -> Ceilings:
        return self.scheduler.ceilings

    # ---- one iteration -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; one RequestOutput per request that got a token (or finished) in it."""
        scheduler = self.scheduler
        start = self.clock()
        output = scheduler.schedule(start)
        self.last_num_scheduled_tokens = output.num_tokens
        if output.is_empty:
            return []
        verifying: dict[str, int] = {}  # request id -> its token count before a verification's tokens
        for chunk in output.chunks:
            request = chunk.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = start
            if chunk.draft:
                verifying[request.request_id] = len(request.token_ids)
        failed: list[RequestOutput] = []
        try:
            executed = self.executor.execute(output)
        except Exception as exc:  # noqa: BLE001 - find the request at fault; the others go on
            executed = self._execute_one_by_one(output, exc, failed)
        sampled, logprobs, dead_ends, accepted = (executed.token_ids, executed.logprobs, executed.dead_ends,
                                                  executed.accepted)
        # appends tokens (a verification's kept drafts too), finishes on EOS, length, a complete grammar, and a
        # grammar's dead end
        scheduler.update_from_output(output, sampled, dead_ends, accepted, executed.deferred)
        now = self.clock()
        observe = getattr(scheduler.prefix_cost, "observe", None)
        if observe is not None:  # a cost model that learns from served iterations (iteration_cost.py)
            _observe_iteration(observe, output, (now - start) * 1000.0)
        observer = self.observer
        if observer is not None:
            evictions = self.kv_cache.num_evictions
            num_evicted, self._num_evictions = evictions - self._num_evictions, evictions
            try:
                observer.on_iteration(IterationRecord(
                    start=start, duration_s=now - start, num_prefill_tokens=output.num_prefill_tokens,
                    num_decode_tokens=output.num_decode_tokens, token_budget=output.token_budget,
                    max_num_seqs=scheduler.tuning.max_num_seqs, num_running=scheduler.num_running,
                    num_waiting=scheduler.num_waiting, num_partial_prefills=scheduler.num_partial_prefills,
                    kv_usage=self.kv_cache.usage, num_preempted=len(output.preempted),
                    kv_reserved=scheduler.kv_reserved, num_evicted_blocks=num_evicted,
                    num_verify_tokens=output.num_verify_tokens, num_accepted_tokens=sum(accepted.values()),
                ))
            except Exception as exc:  # noqa: BLE001 - see _observer_failed
                self._observer_failed("on_iteration", exc)
        self.num_iterations += 1
        outputs = failed
        detokenizers = self._detokenizers
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            request = chunk.request
            detok = detokenizers.get(request.request_id, _GONE)
            if detok is _GONE:
                continue  # aborted since schedule()
            if request.request_id not in sampled:
                if request.status is _DEAD_END:  # finished without a token: flush its held-back text
                    outputs.append(self._finish_without_token(request, detok, now))
                continue
            try:  # zero-cost unless it raises
                token_logprobs = logprobs.get(request.request_id) if logprobs else None
                before = verifying.get(request.request_id)
                if before is None:
                    outputs.append(self._process_token(request, detok, now, token_logprobs))
                else:
                    outputs.append(self._process_tokens(request, detok, now, before, token_logprobs,
                                                        executed.draft_logprobs.get(request.request_id)))
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                outputs.append(self._fail_request(request, f"detokenizing failed: {type(exc).__name__}: {exc}"))
        return outputs

    def _process_token(self, request: Request, detok: IncrementalDetokenizer | None, now: float,
                       sampled_logprobs=None) -> RequestOutput:
        """The new text of the request's newest token; stop strings, observer, release when done."""
        token = request.token_ids[-1]
        done = request.status.finished
        token_logprobs = None
        if detok is None or (done and request.status is _STOPPED and _is_stop_token(request, token)):
            text = ""  # no text asked for; EOS and stop tokens are not part of the text (nor of the logprobs)
        else:
            if sampled_logprobs is not None:
                token_logprobs = [self._token_logprob(sampled_logprobs)]
            text = detok.add_tokens((token,))
            if detok.stopped_by is not None:
                if not done:
                    self.scheduler.finish_request(request.request_id, _STOPPED)
                request.status = _STOPPED  # a stop string wins over a simultaneous length limit
                done = True
        if done and detok is not None:
            text += detok.finish()
        return self._output(request, [token], text, done, now, token_logprobs)

    def _process_tokens(self, request: Request, detok: IncrementalDetokenizer | None, now: float, before: int,
                        sampled_logprobs=None, draft_logprobs=None) -> RequestOutput:
        """A verification's new tokens (its kept drafts, then the sampled token) as one update: _process_token's rules
        token by token; a stop string inside them drops the tokens after it."""
        tokens = request.token_ids[before:]
        done = request.status.finished
        wanted = sampled_logprobs is not None
        all_logprobs = [*(draft_logprobs or ()), sampled_logprobs] if wanted else None
        text_parts: list[str] = []
        token_logprobs: list | None = [] if wanted and detok is not None else None
        kept = len(tokens)
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            if detok is None or (last and done and request.status is _STOPPED and _is_stop_token(request, token)):
                continue
            if token_logprobs is not None:
                token_logprobs.append(self._token_logprob(all_logprobs[i]))
            text_parts.append(detok.add_tokens((token,)))
            if detok.stopped_by is not None:
                kept = i + 1
                if not done:
                    self.scheduler.finish_request(request.request_id, _STOPPED)
                request.status = _STOPPED
                done = True
                break
        if kept < len(tokens):  # generated past a stop string: not part of the answer
            del request.token_ids[before + kept:]
            tokens = tokens[:kept]
        text = "".join(text_parts)
        if done and detok is not None:
            text += detok.finish()
        return self._output(request, tokens, text, done, now, token_logprobs or None)

    def _output(self, request: Request, tokens: list[int], text: str, done: bool, now: float,
                logprobs) -> RequestOutput:
        """The observer sees each new token (the first one sets the first-token time), a finished request is
        released, and the client gets one update."""
        for _ in tokens:
            first = request.first_token_time is None
            if self.observer is not None:
                try:
                    self.observer.on_token(request, now, first)
                except Exception as exc:  # noqa: BLE001 - see _observer_failed
                    self._observer_failed("on_token", exc)
            if first:
                request.first_token_time = now
            request.last_token_time = now
        if done:
            self._release(request, now)
        return RequestOutput(
            request.request_id, tokens, text, done, request.status.value if done else None,
            request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens,
            logprobs=logprobs, num_drafted_tokens=request.num_drafted_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )

    def _finish_without_token(self, request: Request, detok: IncrementalDetokenizer | None,
                              now: float) -> RequestOutput:
        """A request the scheduler finished with no new token (a grammar's dead end)."""
        text = detok.finish() if detok is not None else ""
        self._release(request, now)
        return RequestOutput(request.request_id, [], text, True, request.status.value, request.num_prompt_tokens,
                             request.num_output_tokens, request.num_cached_tokens)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _token_logprob(self, sampled) -> TokenLogprob:
        """The sampler's TokenLogprobs with each token's text (decoded once per token id, then cached)."""
        text = self._token_text
        return TokenLogprob(sampled.token_id, text(sampled.token_id), sampled.logprob,
                            [(t, text(t), lp) for t, lp in sampled.top])

    def _execute_one_by_one(self, output: SchedulerOutput, batch_error: Exception,
                            failed: list[RequestOutput]) -> ExecutorOutput:
        """The batch raised: run each chunk alone so only the requests at fault fail (rare, so no hurry).

        Rewriting a chunk's KV slots with the same values is harmless; the scheduler skips the failed
        requests in update_from_output (they are finished), and advances the others as usual.
        """
        result = ExecutorOutput({})
        if len(output.chunks) == 1:
            failed.append(self._fail_request(output.chunks[0].request, _describe(batch_error)))
            return result
        for chunk in output.chunks:
            alone = SchedulerOutput(chunks=[chunk], token_budget=output.token_budget,
                                    num_prefill_tokens=chunk.num_tokens if chunk.is_prefill else 0,
                                    num_decode_tokens=0 if chunk.is_prefill else 1,
                                    num_verify_tokens=len(chunk.draft))
            try:
                executed = self.executor.execute(alone)
                result.token_ids.update(executed.token_ids)
                result.logprobs.update(executed.logprobs)
                result.dead_ends.update(executed.dead_ends)
                result.accepted.update(executed.accepted)
                result.deferred.update(executed.deferred)
                result.draft_logprobs.update(executed.draft_logprobs)
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                failed.append(self._fail_request(chunk.request, _describe(exc)))
        if failed:
            log.warning("%d of %d requests failed alone in an iteration: %s", len(failed), len(output.chunks),
                        failed[0].error)
        else:  # nothing failed alone: a fault of the batch, not of one request; the iteration is done anyway
            log.warning("an iteration failed as a batch but each request ran alone: %s", _describe(batch_error))
        return result

    def _fail_request(self, request: Request, message: str) -> RequestOutput:
        """Finish one request with finish_reason "error" (KV freed at once); the others are untouched."""
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        request.status = RequestStatus.FINISHED_ERROR
        self._release(request, self.clock())
        return RequestOutput(request.request_id, [], "", True, "error", request.num_prompt_tokens,
                             request.num_output_tokens, request.num_cached_tokens, error=message)

    def _release(self, request: Request, now: float) -> None:
        request.finished_time = now
        if request.draft_state and log.isEnabledFor(logging.DEBUG):
            drafted, accepted = request.num_drafted_tokens, request.num_accepted_tokens
            log.debug("request %s speculation: %d draft tokens, %d accepted, %d rejected, %d outputs",
                      request.request_id, drafted, accepted, drafted - accepted, request.num_output_tokens)
        self._detokenizers.pop(request.request_id, None)
        self._free_executor_state(request.request_id)
        if self.observer is not None:
            try:
                self.observer.on_finished(request, now)
            except Exception as exc:  # noqa: BLE001 - see _observer_failed
                self._observer_failed("on_finished", exc)

    def _observer_failed(self, hook: str, exc: Exception) -> None:
        """Count an observer's fault; log its first of each kind with the traceback (not one line per token)."""
        self.observer_errors[hook] = self.observer_errors.get(hook, 0) + 1
        kind = (hook, type(exc))
        if kind not in self._observer_faults_logged:
            self._observer_faults_logged.add(kind)
            log.error("observer %s raised %s (counted; further ones of this kind are not logged): %s", hook,
                      type(exc).__name__, exc, exc_info=exc)
        if self.on_observer_error is not None:
            self.on_observer_error(hook)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Fail every unfinished request after an engine error; their outputs carry finish_reason "error"."""
        outputs = []
        for request_id in list(self._detokenizers):
            request = self.scheduler.get_request(request_id)
            if request is None:
                self._detokenizers.pop(request_id, None)
                continue
            outputs.append(self._fail_request(request, message))
        return outputs


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _is_stop_token(request: Request, token: int) -> bool:
    sampling = request.sampling
    return token in sampling.stop_token_ids or (token in request.eos_token_ids and not sampling.ignore_eos)


def _observe_iteration(observe: Callable[..., None], output, iteration_ms: float) -> None:
    """Hand a cost model the iteration as it predicts one: decode context lengths, (prefix, tokens) chunks. A
    verification runs as decode rows of its sequence (model_runner.py), one per token, and is costed as them."""
    decode_lens, prefill_chunks = [], []
    for chunk in output.chunks:
        if chunk.is_prefill:
            prefill_chunks.append((chunk.start, chunk.num_tokens))
        elif chunk.draft:
            decode_lens += range(chunk.start + 1, chunk.start + chunk.num_tokens + 1)
        else:
            decode_lens.append(chunk.start + 1)
    observe(decode_lens, prefill_chunks, iteration_ms)
