"""The per-iteration scheduler: Sarathi-Serve's stall-free batching over a paged KV cache.

Each `schedule()` builds one iteration under the live limits (token budget, max_num_seqs, max partial
prefills, long-prefill threshold) in this order:

1. every running decode, one token each (they never lose a step to a newcomer);
   1b. with speculation on (speculation.py), their n-gram drafts' verification tokens, from what the decodes leave
   of the budget: a verification is a decode's own work (each accepted token is an output token of a running
   request, the work the budget exists to protect), so it goes before prefill; every draft token counts in the
   budget like a prefill token, so the iteration still fits the budget's time and no decode stalls; prefill gets
   the rest (the drafts take at most max_draft per decode, and a request whose drafts are not accepted stops
   drafting);
2. the next chunk of each partially prefilled prompt, in admission order;
3. new requests in the waiting queue's order, while budget, sequence slots, the partial-prefill cap and
   KV admission allow; the queue head blocks the rest.

Requests carry an objective when the router signed one (request.py `Objective`): the waiting queue is
ordered by urgency (higher priority first, then the earlier deadline), then arrival; steps 2 and 3 merge
so the prefill chunks go to the most urgent request first (a partial prefill before a waiting request
of the same urgency), decodes still all first. The first prefill chunk sets the iteration's band: no request of
a lower priority gets a prefill chunk beside it (the leftover budget would only lengthen the iteration that carries
the more urgent prefill, so its TTFT); it prefills in iterations without one, and its partial prefill does not
count against the partial-prefill cap of a higher priority's prompt (it would hold that prompt back until its own
finished). Once its deadline is near (half of its time here gone: `_due`), it takes the leftover budget beside a
higher band again, still after it, so a burst of the higher band cannot starve it past its deadline. A preempted request goes back to its own place in that
order, by its original arrival. Without objectives every request has the same urgency, so the queue is
first come, first served (preempted ones resume first: they arrived before any request still waiting)
and the order is the one above. While a running request has a TPOT target tighter than the service's,
the iteration's token budget is capped at the budget for that target (set_tpot_budget).

Every prefill chunk is cut at the leftover budget, at `long_prefill_threshold` when set, and over a long
cached prefix to the budget's iteration time (set_prefix_cost).

KV admission reserves a request's whole prompt (and outputs so far, after a preemption) plus an
estimate of its output length (output_length.py: a running high quantile of this daemon's output
lengths with a margin and a floor), never more than its own bound (prompt plus max_tokens, capped by the
context), against the free blocks, net of prefix-cache hits and of what running requests may still
grow to under their reservations; `watermark_blocks` stay free unless the request would run alone. A
request resumed after it outran the estimate reserves as many outputs again as it already has. When
decoding runs out of KV anyway (the estimate was short), of the running requests not yet scheduled this
iteration the lowest priority, then the latest admitted, is preempted by recompute and queued at its
place; its cached full blocks usually make the recompute a cache hit. `OutputLengthEstimate.worst_case()`
reserves every request's full bound instead, so decoding can never run out of KV.

Priorities are strict at admission too: before each iteration, while the running set is full (max_num_seqs) or
KV is short for the waiting queue's head, and a running request has a strictly lower priority than the head, the
lowest (then the latest admitted) is preempted by the same recompute and keeps its place; the head is admitted
in that iteration, after the survivors' decodes. Equal or higher priorities are never preempted, so requests
without objectives (all priority 0) never are.

Lowering max_num_seqs live below the running count preempts (by the same rule) at the next
step (so the decodes always fit the budget, which validate_tuning keeps above max_num_seqs); lowering
the partial-prefill cap only stops new partial prefills, the ones in flight finish.

A partial prefill is a running request whose prompt (or, after preemption, its recompute) will still be
incomplete after this iteration. A prompt that completes within the iteration never counts.

The engine calls `schedule()`, runs the model, then `update_from_output()` before the next
`schedule()`. The scheduler never reads a clock: the engine (or the simulator) stamps times.

This is the one policy the daemon serves. The simulator's baselines (prefill-priority, decode-priority,
the iteration-time-target chunker) subclass it in simulator/baseline_schedulers.py, through `_schedule`
(one iteration's policy) and `_chunk_size` (one prefill chunk's size).
"""
from __future__ import annotations

from bisect import insort
from collections import deque
from dataclasses import replace
from typing import Collection, Protocol

from stallfree.contracts import Ceilings, Tuning, min_budget_for, validate_tuning
from stallfree.node_daemon.engine.config import SchedulerConfig
from stallfree.node_daemon.engine.kv_cache_manager import KVCacheManager
from stallfree.node_daemon.engine.output_length import OutputLengthEstimate
from stallfree.node_daemon.engine.request import Request, RequestStatus
from stallfree.node_daemon.engine.request_rules import kv_footprint
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from stallfree.node_daemon.engine.speculation import DraftState, SpeculativeConfig, can_draft

_RUNNING = RequestStatus.RUNNING
_STOPPED = RequestStatus.FINISHED_STOPPED
_DEAD_END = RequestStatus.FINISHED_GRAMMAR_DEAD_END
_LENGTH = RequestStatus.FINISHED_LENGTH


class PrefixCostModel(Protocol):
    """Cuts a chunk over `prefix_len` cached tokens so its iteration costs no more than `token_budget` fresh ones."""

    def chunk_within_budget(self, limit: int, used: int, prefix_len: int, token_budget: int) -> int: ...


class TpotBudgetModel(Protocol):
    """The token budget whose iteration fits a TPOT target (node_daemon/engine/iteration_cost.py)."""

    def budget_for_tpot(self, tpot_ms: float) -> int: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, *,
                 output_estimate: OutputLengthEstimate | None = None) -> None:
        validate_tuning(config.tuning, config.ceilings)
        self.config = config
        self.kv_cache = kv_cache
        # Output tokens reserved at admission for requests whose own bound is larger (per daemon, learned).
        self.output_estimate = output_estimate if output_estimate is not None else OutputLengthEstimate()
        self._tuning = config.tuning
        self._block_size = kv_cache.block_size
        self.prefix_cost: PrefixCostModel | None = None
        self.tpot_budget: TpotBudgetModel | None = None
        self.service_tpot_ms: float | None = None
        # In queue order: by urgency (request.py), then arrival; without objectives, arrival order.
        self.waiting: deque[Request] = deque()
        self._num_arrivals = 0
        # Running requests with a TPOT target of their own: while there are any, the budget may be capped.
        self._num_tpot_targets = 0
        # Unfinished requests with an objective: without any, the iteration takes today's first come, first served path.
        self._num_objectives = 0
        self._requests: dict[str, Request] = {}  # every unfinished request
        self.num_paused = 0  # of those, paused (set_paused): their decodes are skipped
        # The running requests: those that decode and those still prefilling, each list in admission order
        # (the hot loops walk one each; the latest admitted is one of the two tails).
        self._decoding: list[Request] = []
        self._prefilling: list[Request] = []
        # Running request -> (admission number, KV blocks reserved at admission); and the sum of the blocks
        # running requests may still take under their reservations.
        self._admitted: dict[str, tuple[int, int]] = {}
        self._num_admissions = 0
        self._growth_blocks = 0
        self._num_partial_prefills = 0
        self.num_preemptions = 0
        self._num_made_room = 0  # preempted in this iteration to admit a higher priority (_make_room)
        self._now: float | None = None  # this iteration's time, when the engine gives it (_due)
        self.speculative: SpeculativeConfig = config.speculative

    # ---- live limits -------------------------------------------------------------------------------

    @property
    def tuning(self) -> Tuning:
        return self._tuning

    @property
    def ceilings(self) -> Ceilings:
        return self.config.ceilings

    def set_prefix_cost(self, model: PrefixCostModel | None) -> None:
        """From the next schedule() on, cut prefill chunks over a cached prefix so that an iteration's time stays
        what the token budget means (node_daemon/engine/iteration_cost.py); None stops it."""
        self.prefix_cost = model

    def set_tpot_budget(self, model: TpotBudgetModel | None, service_tpot_ms: float | None) -> None:
        """From the next schedule() on, while a running request's TPOT target is tighter than `service_tpot_ms`
        (any target, when None), cap the iteration's token budget at `model`'s budget for the tightest target;
        None stops it."""
        self.tpot_budget = model
        self.service_tpot_ms = service_tpot_ms

    def set_tuning(self, tuning: Tuning) -> None:
        """Validate against the ceilings (raises TuningError) and take effect at the next schedule()."""
        validate_tuning(tuning, self.config.ceilings)
        self._tuning = tuning

    # ---- request lifecycle -------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self._decoding) + len(self._prefilling)

    @property
    def running(self) -> list[Request]:
        """The running requests in admission order (a new list)."""
        admitted = self._admitted
        return sorted(self._decoding + self._prefilling, key=lambda r: admitted[r.request_id][0])

    @property
    def num_partial_prefills(self) -> int:
        """Running requests whose prefill stays incomplete after the last scheduled iteration."""
        return self._num_partial_prefills

    @property
    def num_reserved_blocks(self) -> int:
        """KV blocks running requests hold plus those their reservations still promise them."""
        return self.kv_cache.num_used_blocks + self._growth_blocks

    @property
    def kv_reserved(self) -> float:
        """num_reserved_blocks as a share of the cache (above 1 once requests outgrew short estimates)."""
        return self.num_reserved_blocks / self.kv_cache.num_blocks

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def set_paused(self, request_id: str, paused: bool) -> bool:
        """Pause (skip its decodes, keep its KV) or resume a request whose client stopped or started reading its
        stream again; False if it is unknown or finished."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.paused != paused:
            request.paused = paused
            self.num_paused += 1 if paused else -1
        return True

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a new request. It was checked before it got here (engine/request_rules.py: the engine, or the server
        before admission); a request that breaks what those rules guarantee is its caller's bug (AssertionError)."""
        num_prompt = request.num_prompt_tokens
        max_model_len = min(request.max_model_len, self.config.max_model_len)
        _invariant(request.request_id not in self._requests, f"request id {request.request_id!r} is already in flight")
        _invariant(request.status is RequestStatus.WAITING and not request.num_computed_tokens
                   and not request.block_ids, f"request {request.request_id!r} was already scheduled once")
        _invariant(0 < num_prompt < max_model_len, f"a prompt of {num_prompt} tokens in a context of {max_model_len}")
        kv_tokens = kv_footprint(num_prompt, request.sampling.max_tokens, max_model_len)
        _invariant(self.kv_cache.blocks_for(kv_tokens) <= self.kv_cache.num_blocks,
                   f"{kv_tokens} tokens of KV in a cache of {self.kv_cache.num_blocks} blocks")
        request.max_model_len = max_model_len
        self.kv_cache.hash_prompt(request)
        self._requests[request.request_id] = request
        self._num_arrivals += 1
        request.arrival_seq = self._num_arrivals
        if request.objective is not None:
            self._num_objectives += 1
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue at its place: by urgency, then arrival (usually the tail: O(1))."""
        waiting = self.waiting
        if not waiting or _queue_key(waiting[-1]) < _queue_key(request):
            waiting.append(request)
        else:
            insort(waiting, request, key=_queue_key)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish as aborted and free its KV blocks at once; None if unknown or already finished."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish with `status` (the engine's stop strings, aborts); unknown or finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.paused:
            request.paused = False
            self.num_paused -= 1
        if request.status is _RUNNING:
            self._remove_running(request)
        else:
            self.waiting.remove(request)
        if request.objective is not None:
            self._num_objectives -= 1
        request.status = status
        self.kv_cache.free(request)
        if status is _STOPPED:  # a stop string seen by the engine: the request ended by itself
            self.output_estimate.observe(request.num_output_tokens, True)

    # ---- one iteration -----------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """One iteration. `now` (the engine's clock, as arrival times and deadlines) lets a lower priority's request
        whose deadline is near take the leftover budget beside a higher one (`_due`); without it, none is due."""
        self._now = now
        tuning = self._tuning
        if self._num_tpot_targets and self.tpot_budget is not None:
            tuning = self._tpot_capped(tuning)
        out = SchedulerOutput(token_budget=tuning.token_budget)
        while self.num_running > tuning.max_num_seqs:  # max_num_seqs was lowered live
            self._preempt(self._victim(out), out)
        self._num_made_room = self._make_room(out, tuning) if self._num_objectives and self.waiting else 0
        self._schedule(out, tuning)
        return out

    def _make_room(self, out: SchedulerOutput, tuning: Tuning) -> int:
        """Strict priority: while the running set is full, or KV is short for the waiting queue's head, and a running
        request has a strictly lower priority than the head, preempt the lowest (_victim: recompute, it keeps its
        place in the queue, behind the head). Equal or higher priorities are never preempted. Returns how many."""
        head = self.waiting[0]
        made = 0
        while self._decoding or self._prefilling:
            if self.num_running < tuning.max_num_seqs and self._fits(head):
                break
            victim = self._victim(out)
            if victim.priority >= head.priority:
                break
            self._preempt(victim, out)
            made += 1
        return made

    def _fits(self, request: Request) -> bool:
        """Would its admission's KV reservation fit the free blocks now (_admit's test)?"""
        hits, _ = self.kv_cache.get_computed_blocks(request)
        need, _ = self._admission_need(request, hits)
        watermark = self.config.watermark_blocks if self._admitted else 0
        return need + self._growth_blocks + watermark <= self.kv_cache.num_free_blocks

    def _tpot_capped(self, tuning: Tuning) -> Tuning:
        """The tuning with its budget capped for the tightest TPOT target among running requests, when that target
        is tighter than the service's; never below the room every running decode needs beside a prefill."""
        tightest = min(r.objective.tpot_target_ms for r in (*self._decoding, *self._prefilling)
                       if r.objective is not None and r.objective.tpot_target_ms is not None)
        service = self.service_tpot_ms
        if service is not None and tightest >= service:
            return tuning
        cap = max(self.tpot_budget.budget_for_tpot(tightest), min_budget_for(self.num_running))
        return replace(tuning, token_budget=cap) if cap < tuning.token_budget else tuning

    def _schedule(self, out: SchedulerOutput, tuning: Tuning) -> None:
        """One stall-free iteration into `out` (a baseline policy overrides this)."""
        kv = self.kv_cache

        # 1. Every running decode, one token each.
        self._schedule_decodes(out)
        chunks = out.chunks
        num_decodes = len(chunks)
        budget = tuning.token_budget - num_decodes
        # 1b. Their drafts' verification tokens, from what the decodes leave of the budget, while the iteration's
        # rows stay where a row is cheap (speculation.py: max_rows).
        speculative = self.speculative
        if speculative.enabled and budget > 0:
            room = budget if not speculative.max_rows else min(budget, speculative.max_rows - num_decodes)
            if room > 0:
                budget -= self._schedule_drafts(out, room)

        # 2. The next chunk of every partial prefill, in admission order. A KV shortfall here preempts
        # the latest admitted partial prefill (decodes were all scheduled already).
        # 3. New (and preempted) requests in the queue's order. Not after a preemption in this iteration: KV is
        # short, and the victim would only take back the room it just gave. With objectives, 2 and 3 merge by
        # urgency (a waiting request before a partial prefill only when strictly more urgent).
        partials = self._prefilling
        if self._num_objectives:
            partials = sorted(partials, key=_urgency)  # stable: admission order within one urgency
        else:
            partials = partials[:]
        waiting = self.waiting
        admitting = True
        num_partial = 0
        num_running = self.num_running
        # With objectives, the first prefill chunk sets the iteration's band: a lower priority's chunk would only
        # lengthen the iteration that carries a more urgent request's prefill (its TTFT); it waits for one without.
        band: int | None = None
        i = 0
        while True:
            while i < len(partials) and partials[i].status is not _RUNNING:
                i += 1  # preempted in this iteration
            partial = partials[i] if i < len(partials) else None
            if band is not None and waiting and waiting[0].priority < band and not self._due(waiting[0]):
                admitting = False
            if (admitting and waiting and budget > 0 and num_running < tuning.max_num_seqs
                    and len(out.preempted) <= self._num_made_room
                    and (partial is None or waiting[0].urgency < partial.urgency)):
                request = waiting[0]
                hits, num_hit_tokens = kv.get_computed_blocks(request)
                remaining = request.num_tokens - num_hit_tokens
                n = self._chunk_size(remaining, budget, tuning, num_hit_tokens, chunks)
                # Partial prefills not given their chunk yet count as partial: they may stay so. A lower priority's
                # does not: it gets no chunk beside this one (the band rule), so it never holds this prompt back.
                in_flight = 0 if partial is None else sum(r.status is _RUNNING and r.priority >= request.priority
                                                          for r in partials[i:])
                if (n <= 0 or (n < remaining and num_partial + in_flight >= tuning.max_partial_prefills)
                        or not self._admit(request, hits, n)):
                    admitting = False  # the head blocks the rest
                    continue
                num_running += 1
                chunks.append(ScheduledChunk(request, num_hit_tokens, n, True, n == remaining))
                budget -= n
                if band is None and self._num_objectives:
                    band = request.priority
                if n < remaining:
                    num_partial += 1
                continue
            if partial is None:
                break
            i += 1
            request = partial
            start = request.num_computed_tokens
            remaining = request.num_tokens - start
            below_band = band is not None and request.priority < band and not self._due(request)
            n = 0 if below_band else self._chunk_size(remaining, budget, tuning, start, chunks)
            if n <= 0:
                num_partial += 1
                continue
            if not self._grow(request, n, out):
                break
            chunks.append(ScheduledChunk(request, start, n, True, n == remaining))
            budget -= n
            if band is None and self._num_objectives:
                band = request.priority
            if n < remaining:
                num_partial += 1
        out.num_decode_tokens = num_decodes
        out.num_prefill_tokens = tuning.token_budget - num_decodes - out.num_verify_tokens - budget
        self._num_partial_prefills = num_partial

    def _due(self, request: Request) -> bool:
        """Its deadline is near: less than DUE_SHARE of the time it had from its arrival here is left. Strict priority
        alone would starve it through a burst of a higher band that its shedding at the router could not foresee; due,
        it takes what a higher band's prefill leaves of the budget (never more: that band still goes first)."""
        objective, now = request.objective, self._now
        if objective is None or objective.deadline is None or now is None or request.arrival_time is None:
            return False
        return objective.deadline - now < DUE_SHARE * (objective.deadline - request.arrival_time)

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        """One token for every running decode; a decode needs a new block only at a block boundary.

        In admission order, the highest priority first when they differ: the victim of a KV shortfall is never a
        request scheduled earlier in this loop (_victim), so the lowest priority is still there to be preempted.
        """
        block_size = self._block_size
        chunks = out.chunks
        decoding = sorted(self._decoding, key=_by_priority) if self._num_objectives else self._decoding[:]
        for request in decoding:
            if request.status is not _RUNNING or request.paused:
                continue  # preempted in this loop, or its client is not reading
            start = request.num_computed_tokens
            if start >= len(request.block_ids) * block_size and not self._grow(request, 1, out):
                continue  # it preempted itself
            chunks.append(ScheduledChunk(request, start, 1, False, True))
        out.num_decode_tokens = len(chunks)

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Turn decodes into verifications of their n-gram drafts, within `budget` tokens; returns the tokens used.

        Each draft is at most its request's adapted length (speculation.py), what max_tokens and the context leave,
        and the budget left; its KV slots are taken only from free blocks (a draft never preempts). With objectives,
        a request drafts only while no waiting or prefilling request is of a higher priority: its drafts would
        lengthen the iteration that request's prefill needs (the band rule's reason)."""
        config = self.speculative
        floor = None
        if self._num_objectives:  # the waiting queue's head has its highest priority
            head = (self.waiting[0],) if self.waiting else ()
            floor = max((r.priority for r in (*head, *self._prefilling)), default=None)
        used = 0
        for chunk in out.chunks:
            if used >= budget:
                break
            request = chunk.request
            state = request.draft_state
            if state is None:
                state = request.draft_state = (DraftState(config) if can_draft(request.sampling,
                                                                                  request.matcher is not None)
                                               else False)
            if state is False or (floor is not None and request.priority < floor):
                continue
            num_tokens = len(request.token_ids)
            room = min(budget - used, request.num_prompt_tokens + request.sampling.max_tokens - num_tokens - 1,
                       request.max_model_len - num_tokens - 1)
            if room <= 0:
                continue
            limit = state.draft_len()
            if limit <= 0:
                continue
            draft = state.propose(request.token_ids, min(limit, room))
            if not draft or not self._grow_without_preempting(request, 1 + len(draft)):
                continue
            chunk.draft = draft
            chunk.num_tokens = 1 + len(draft)
            used += len(draft)
        out.num_verify_tokens = used
        return used

    def _chunk_size(self, remaining: int, budget: int, tuning: Tuning, prefix_len: int,
                    chunks: list[ScheduledChunk]) -> int:
        """Tokens of this prefill to run now: the leftover budget, the long-prefill cap, the prefix cut.

        `chunks` is the iteration so far (the simulator's time-target baseline predicts its time)."""
        n = remaining if remaining < budget else budget
        if 0 < tuning.long_prefill_threshold < n:
            n = tuning.long_prefill_threshold
        if self.prefix_cost is not None and prefix_len > 0:
            n = self.prefix_cost.chunk_within_budget(n, tuning.token_budget - budget, prefix_len, tuning.token_budget)
        return n

    # ---- KV admission, growth and preemption -------------------------------------------------------

    def _admit(self, request: Request, hits: list[int], num_new_tokens: int) -> bool:
        """Move the queue head to running if its reserved footprint fits the free blocks; else False."""
        kv = self.kv_cache
        need, reserve_tokens = self._admission_need(request, hits)
        watermark = self.config.watermark_blocks if self._admitted else 0
        if need + self._growth_blocks + watermark > kv.num_free_blocks:
            return False
        if not kv.allocate_slots(request, num_new_tokens, hits):
            return False
        self.waiting.popleft()
        request.status = _RUNNING
        request.num_computed_tokens = num_hit_tokens = len(hits) * self._block_size
        request.num_cached_tokens = min(num_hit_tokens, request.num_prompt_tokens)  # prompt tokens only
        reserved = kv.blocks_for(reserve_tokens)
        self._growth_blocks += max(0, reserved - len(request.block_ids))
        self._num_admissions += 1
        self._admitted[request.request_id] = (self._num_admissions, reserved)
        self._prefilling.append(request)
        if request.objective is not None and request.objective.tpot_target_ms is not None:
            self._num_tpot_targets += 1
        return True

    def _admission_need(self, request: Request, hits: list[int]) -> tuple[int, int]:
        """(free blocks its admission takes, tokens it reserves): its prompt (and outputs so far) plus the estimate."""
        num_prompt = request.num_prompt_tokens
        final_kv_tokens = max(num_prompt, request.max_total_tokens - 1)  # the last token never needs KV
        expected_outputs = max(self.output_estimate.tokens, 2 * request.num_output_tokens)
        reserve_tokens = max(request.num_tokens, min(final_kv_tokens, num_prompt + expected_outputs - 1))
        return self.kv_cache.blocks_to_admit(hits, reserve_tokens), reserve_tokens

    def _grow(self, request: Request, num_new_tokens: int, out: SchedulerOutput) -> bool:
        """Room for a running request's next tokens, preempting if KV is short (_victim); False if it had to go
        itself."""
        kv = self.kv_cache
        before = len(request.block_ids)
        while not kv.allocate_slots(request, num_new_tokens):
            victim = self._victim(out)
            self._preempt(victim, out)
            if victim is request:
                return False
        self._blocks_changed(request, before)
        return True

    def _grow_without_preempting(self, request: Request, num_new_tokens: int) -> bool:
        """Room for a draft's slots from free blocks alone; False (nothing changed) when KV is short."""
        before = len(request.block_ids)
        if not self.kv_cache.allocate_slots(request, num_new_tokens):
            return False
        self._blocks_changed(request, before)
        return True

    def _blocks_changed(self, request: Request, before: int) -> None:
        """Keep the growth still promised to running requests right after a request's block table changed size."""
        reserved = self._admitted[request.request_id][1]
        after = len(request.block_ids)
        if after != before:
            self._growth_blocks -= max(0, reserved - before) - max(0, reserved - after)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Preempt by recompute: free its KV, queue it at its place (by urgency, then its original arrival: ahead
        of every request that came after it)."""
        self._remove_running(request)
        request.status = RequestStatus.PREEMPTED
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)
        out.preempted.append(request)

    def _victim(self, out: SchedulerOutput) -> Request:
        """Of the running requests not yet scheduled in this iteration, the lowest priority, then the latest admitted.

        Without priorities this is the latest admitted not yet scheduled: decodes are scheduled in admission
        order, so it is the later of the two lists' tails while they are, the tail of the partial prefills after.
        """
        scheduled = {id(chunk.request) for chunk in out.chunks}
        admitted = self._admitted
        return min((r for r in (*self._decoding, *self._prefilling) if id(r) not in scheduled),
                   key=lambda r: (r.priority, -admitted[r.request_id][0]))

    def _remove_running(self, request: Request) -> None:
        """Take a running request out of its list and give back its reservation."""
        if request.objective is not None and request.objective.tpot_target_ms is not None:
            self._num_tpot_targets -= 1
        if self._prefilling and request in self._prefilling:
            self._prefilling.remove(request)
        else:
            self._decoding.remove(request)
        reserved = self._admitted.pop(request.request_id)[1]
        self._growth_blocks -= max(0, reserved - len(request.block_ids))

    # ---- after the model ran -----------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int],
                           dead_ends: Collection[str] = (), accepted: dict[str, int] | None = None,
                           deferred: Collection[str] = ()) -> list[Request]:
        """Advance every scheduled request, append sampled tokens, finish the stopped; returns those finished.

        Call once per schedule(), before the next one. A prefill whose chunk sampled now decodes. A request in
        `dead_ends` (its grammar allowed no token, or refused the one sampled) finishes with grammar_dead_end and
        no token; a constrained request whose grammar is complete finishes "stop", with ignore_eos too (nothing
        but EOS could follow). A verification keeps its draft's first `accepted[request_id]` tokens (their KV is
        computed), then the sampled token; the rejected draft tokens' slots are rolled back (_verified). A request in
        `deferred` (its grammar's mask was not ready) gets no token: its newest token is computed again next time.
        """
        finished: list[Request] = []
        started_decoding: list[Request] = []
        block_size = self._block_size
        kv = self.kv_cache
        caching = kv.enable_prefix_caching
        for chunk in output.chunks:
            request = chunk.request
            if request.status is not _RUNNING:
                continue  # aborted or finished by the engine since schedule()
            if chunk.draft:
                if self._verified(request, chunk, sampled, accepted):
                    finished.append(request)
                continue
            start = chunk.start
            num_tokens = chunk.num_tokens
            sits_out = chunk.samples and deferred and request.request_id in deferred
            if sits_out:
                num_tokens -= 1  # its slot is written again, with the same values, when it samples
            request.num_computed_tokens = start + num_tokens
            if caching and start % block_size + num_tokens >= block_size:
                kv.cache_full_blocks(request)
            if not chunk.samples or sits_out:
                continue
            if dead_ends and request.request_id in dead_ends:
                request.status = _DEAD_END
                finished.append(request)
                continue
            try:
                token = sampled[request.request_id]
            except KeyError:
                raise KeyError(f"no sampled token for request {request.request_id!r}, whose chunk samples") from None
            if not _append_token(request, token):
                if chunk.is_prefill:
                    started_decoding.append(request)
                continue
            finished.append(request)
        if started_decoding:
            admitted = self._admitted
            prefilling, decoding = self._prefilling, self._decoding
            for request in started_decoding:
                prefilling.remove(request)
                insort(decoding, request, key=lambda r: admitted[r.request_id][0])
        if finished:
            requests = self._requests
            observe = self.output_estimate.observe
            for request in finished:
                del requests[request.request_id]
                if request.objective is not None:
                    self._num_objectives -= 1
                self._remove_running(request)
                kv.free(request)
                observe(request.num_output_tokens, request.status is _STOPPED)
        return finished


    def _verified(self, request: Request, chunk: ScheduledChunk, sampled: dict[str, int],
                  accepted: dict[str, int] | None) -> bool:
        """Keep a verification's accepted draft tokens and its sampled token (stopping at the first that finishes the
        request), count the outcome for the draft's adaptation, and give back the rejected tokens' KV: the sequence's
        computed length stops after the accepted tokens (the rejected slots are written again before they are read),
        and blocks past it are freed. True if the request finished."""
        draft = chunk.draft
        num_accepted = accepted.get(request.request_id, 0) if accepted else 0
        try:
            token = sampled[request.request_id]
        except KeyError:
            raise KeyError(f"no sampled token for request {request.request_id!r}, whose chunk samples") from None
        request.draft_state.observe(len(draft), num_accepted)
        done = False
        for t in (*draft[:num_accepted], token):
            if _append_token(request, t):
                done = True
                break
        # KV is computed for the newest token and the accepted drafts (fewer when one of them finished it).
        request.num_computed_tokens = min(chunk.start + 1 + num_accepted, len(request.token_ids))
        kv = self.kv_cache
        if kv.enable_prefix_caching:
            kv.cache_full_blocks(request)
        if not done:
            before = len(request.block_ids)
            kv.trim(request, request.num_computed_tokens)
            self._blocks_changed(request, before)
        return done


def _append_token(request: Request, token: int) -> bool:
    """Append a sampled token; True (status set) if it finishes the request: EOS or a stop token, a complete grammar,
    max_tokens or the context."""
    request.append_output_token(token)
    num_tokens = len(request.token_ids)
    sampling = request.sampling
    if (token in request.eos_token_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids:
        request.status = _STOPPED
    elif request.matcher is not None and request.matcher.is_terminated():
        request.status = _STOPPED
    elif num_tokens - request.num_prompt_tokens >= sampling.max_tokens or num_tokens >= request.max_model_len:
        request.status = _LENGTH
    else:
        return False
    return True


# A lower priority's request is due once less than this share of its time (its arrival here to its deadline) is left.
DUE_SHARE = 0.5


def _by_priority(request: Request) -> int:
    return -request.priority


def _urgency(request: Request) -> tuple[int, float]:
    return request.urgency


def _queue_key(request: Request) -> tuple[int, float, int]:
    urgency = request.urgency
    return urgency[0], urgency[1], request.arrival_seq


def _invariant(holds: bool, what: str) -> None:
    if not holds:
        raise AssertionError(f"scheduler invariant broken: {what} (requests are checked before the scheduler: "
                             "engine/request_rules.py)")
