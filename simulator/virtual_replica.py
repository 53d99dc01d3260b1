"""One serving replica in virtual time: the real Scheduler and KVCacheManager, time from the cost model.

What a closed-loop control run, `stallfree simulate` and capacity searches drive instead of a daemon.
Arrivals are submitted with their (virtual) arrival time; `advance_to(t)` runs iterations back to back
while there is work and jumps idle gaps; `window_stats` answers exactly what a daemon's /admin/stats
would (the daemon's own StatsWindow, fed on the virtual clock); `set_tuning` is the live PUT.

Timestamps follow the engine's conventions: a token is produced at the end of its iteration, queue wait
runs from arrival to the first iteration that schedules the request, TPOT is per finished request.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from stallfree.contracts import Ceilings, Profile, Tuning, WindowStats, validate_tuning
from stallfree.node_daemon.engine.config import CacheConfig, SchedulerConfig
from stallfree.node_daemon.engine.engine_protocol import EngineObserver, IterationRecord
from stallfree.node_daemon.engine.kv_cache_manager import KVCacheManager
from stallfree.node_daemon.engine.request import Request
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.scheduler import Scheduler
from stallfree.node_daemon.sim.backend import build_cost_model, sim_num_kv_blocks
from stallfree.node_daemon.sim.cost_model import IterationCostModel, ProfileCostModel, RooflineCostModel
from stallfree.node_daemon.sim.sim_executor import SimExecutor, VirtualClock
from stallfree.node_daemon.engine.stats_window import StatsWindow


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline in virtual seconds (kept when the replica is asked to keep records)."""

    request_id: str
    arrival_s: float
    prompt_len: int
    max_tokens: int
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    itl_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finished_s is None or self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.num_output_tokens - 1)


class VirtualReplica:
    def __init__(
        self,
        cost_model: IterationCostModel,
        scheduler_config: SchedulerConfig | None = None,
        num_kv_blocks: int = 100_000,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        name: str = "replica",
        stats_window_s: float | tuple[float, ...] = 30.0,
        keep_records: bool = False,
        observer: EngineObserver | None = None,
        start_time: float = 0.0,
    ) -> None:
        self.name = name
        self.cost_model = cost_model
        self.config = scheduler_config or SchedulerConfig()
        validate_tuning(self.config.tuning, self.config.ceilings)
        self.clock = VirtualClock(start_time)
        self.kv_cache = KVCacheManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.kv_cache, cost_model=cost_model)
        self.executor = SimExecutor(cost_model, clock=self.clock, vocab_size=256)
        self.keep_records = keep_records
        self.records: dict[str, RequestRecord] = {}
        self.finished: list[RequestRecord] = []
        self._observer = observer
        # One daemon StatsWindow per window length asked for at construction (definitions as /admin/stats).
        lengths = (stats_window_s,) if isinstance(stats_window_s, (int, float)) else tuple(stats_window_s)
        self.stats_window_s = float(lengths[0])
        self._windows: dict[float, StatsWindow] = {float(w): StatsWindow(w, clock=self.clock) for w in lengths}
        self._arrivals: list[tuple[float, int, Request]] = []  # heap: not yet arrived
        self._seq = itertools.count()
        self._live: dict[str, Request] = {}
        self.num_submitted = 0
        self.num_finished = 0
        self.num_iterations = 0
        self.busy_s = 0.0

    @classmethod
    def for_model(
        cls,
        model: str = "llama-3-8b",
        hardware: str = "h100",
        tuning: Tuning | None = None,
        ceilings: Ceilings | None = None,
        policy: str = "stall_free",
        max_model_len: int = 8192,
        iteration_time_target_ms: float | None = None,
        dtype: str = "bfloat16",
        block_size: int = 16,
        kv_memory_fraction: float = 0.9,
        tflops: float | None = None,
        hbm_tbps: float | None = None,
        overhead_ms: float | None = None,
        **kwargs,
    ) -> "VirtualReplica":
        """A replica of a named model shape on a hardware preset, KV cache sized from device memory."""
        cost_model = build_cost_model(model, hardware, dtype, tflops=tflops, hbm_tbps=hbm_tbps, overhead_ms=overhead_ms)
        config = SchedulerConfig(ceilings=ceilings or Ceilings(), tuning=tuning or Tuning(),
                                 max_model_len=max_model_len, policy=policy,
                                 iteration_time_target_ms=iteration_time_target_ms)
        num_blocks = sim_num_kv_blocks(cost_model, block_size, kv_memory_fraction)
        return cls(cost_model, config, num_kv_blocks=num_blocks, block_size=block_size, **kwargs)

    # ---- driving ---------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.clock.now

    def submit(self, prompt_len: int, max_tokens: int, arrival_time: float | None = None,
               prompt_token_ids: list[int] | None = None, request_id: str | None = None) -> str:
        """Queue a request arriving at `arrival_time` (default: now); returns its id."""
        if prompt_token_ids is None:
            if prompt_len < 1:
                raise ValueError(f"prompt_len must be at least 1, got {prompt_len}")
            # Distinct leading tokens per request: no accidental prefix-cache hits between requests.
            n = self.num_submitted
            prompt_token_ids = [n % 251, (n // 251) % 251, (n // 63001) % 251] + [
                (n + k) % 256 for k in range(max(0, prompt_len - 3))]
            prompt_token_ids = prompt_token_ids[:prompt_len]
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if len(prompt_token_ids) + max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)}) plus max_tokens ({max_tokens}) exceeds "
                             f"max_model_len {self.config.max_model_len}")
        arrival = self.clock.now if arrival_time is None else arrival_time
        request_id = request_id or f"{self.name}-{self.num_submitted}"
        request = Request(request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          arrival_time=arrival, max_model_len=self.config.max_model_len)
        heapq.heappush(self._arrivals, (arrival, next(self._seq), request))
        self.num_submitted += 1
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort a request that arrived (a not yet arrived one is dropped from the queue)."""
        for i, (_, _, request) in enumerate(self._arrivals):
            if request.request_id == request_id:
                self._arrivals.pop(i)
                heapq.heapify(self._arrivals)
                return True
        if self._live.pop(request_id, None) is None:
            return False
        self.scheduler.abort_request(request_id)
        self.records.pop(request_id, None)
        return True

    def advance_to(self, t: float) -> None:
        """Run until virtual time `t`: iterations back to back while there is work, idle gaps skipped.

        An iteration that starts before `t` finishes after it, as on a real device; the clock may overshoot.
        """
        clock = self.clock
        scheduler = self.scheduler
        while True:
            self._admit_arrivals()
            if scheduler.num_waiting + scheduler.num_running > 0 and clock.now < t:
                if self._step():
                    continue
            next_arrival = self._arrivals[0][0] if self._arrivals else None
            if next_arrival is None or next_arrival > t:
                if clock.now < t:
                    clock.now = t
                return
            if next_arrival > clock.now:
                clock.now = next_arrival

    def run_until_idle(self, limit_s: float = float("inf")) -> None:
        """Advance until every submitted request finished (or `limit_s` of virtual time)."""
        while (self._arrivals or self.scheduler.num_waiting + self.scheduler.num_running) and self.clock.now < limit_s:
            horizon = self._arrivals[-1][0] if self._arrivals else self.clock.now
            self.advance_to(min(limit_s, max(horizon, self.clock.now) + 60.0))

    def set_tuning(self, tuning: Tuning) -> None:
        """The live PUT /admin/tuning: validated against the ceilings, applied from the next iteration."""
        validate_tuning(tuning, self.config.ceilings)
        self.scheduler.set_tuning(tuning)
        self.config.tuning = tuning

    # ---- observing -------------------------------------------------------------------------

    @property
    def tuning(self) -> Tuning:
        return self.config.tuning

    @property
    def ceilings(self) -> Ceilings:
        return self.config.ceilings

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_pending(self) -> int:
        """Submitted requests whose arrival time has not come yet."""
        return len(self._arrivals)

    @property
    def kv_usage(self) -> float:
        return self.kv_cache.usage

    def window_stats(self, now: float | None = None, window_s: float | None = None) -> WindowStats:
        """/admin/stats of this replica over the last `window_s` virtual seconds (exact percentiles).

        `window_s` must be one of the lengths given as `stats_window_s` (default: the first of them).
        """
        window = self._windows.get(float(window_s or self.stats_window_s))
        if window is None:
            raise ValueError(f"replica {self.name!r} keeps stats windows of {sorted(self._windows)} s, not {window_s}: "
                             f"pass the length as stats_window_s")
        return window.snapshot(
            self.config.tuning, self.config.ceilings, now=self.clock.now if now is None else now,
            num_waiting=self.scheduler.num_waiting, num_running=self.scheduler.num_running,
            kv_usage=self.kv_cache.usage)

    def profile(self, max_tokens: int | None = None) -> Profile:
        """/admin/profile of this replica, predicted by its cost model."""
        if isinstance(self.cost_model, ProfileCostModel):
            return self.cost_model.profile
        if not isinstance(self.cost_model, RooflineCostModel):
            raise TypeError(f"no profile for a {type(self.cost_model).__name__}")
        return self.cost_model.profile(max_tokens=max_tokens or self.config.ceilings.max_token_budget,
                                       max_num_seqs=self.config.ceilings.max_num_seqs)

    # ---- internals -------------------------------------------------------------------------

    def _admit_arrivals(self) -> None:
        arrivals, now = self._arrivals, self.clock.now
        while arrivals and arrivals[0][0] <= now:
            arrival, _, request = heapq.heappop(arrivals)
            self.scheduler.add_request(request)
            self._live[request.request_id] = request
            for window in self._windows.values():
                window.on_arrival(request.num_prompt_tokens, arrival)
            if self.keep_records:
                self.records[request.request_id] = RequestRecord(request.request_id, arrival,
                                                                 request.num_prompt_tokens, request.sampling.max_tokens)

    def _step(self) -> bool:
        """One iteration; False when the scheduler had nothing it could run."""
        output = self.scheduler.schedule()
        if output.is_empty:
            return False
        start = self.clock.now
        records = self.records if self.keep_records else None
        for chunk in output.chunks:
            request = chunk.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = start
                if records is not None:
                    records[request.request_id].first_scheduled_s = start
        sampled = self.executor.execute(output)
        now = self.clock.now
        finished = self.scheduler.update_from_output(output, sampled)
        self.num_iterations += 1
        self.busy_s += now - start
        observers = list(self._windows.values())
        if self._observer is not None:
            observers.append(self._observer)
        live = self._live
        for request_id in sampled:
            request = live.get(request_id)
            if request is None:
                continue
            first = request.first_token_time is None
            for observer in observers:
                observer.on_token(request, now, first)
            if records is not None:
                record = records[request_id]
                if first:
                    record.first_token_s = now
                else:
                    record.itl_s.append(now - request.last_token_time)
            if first:
                request.first_token_time = now
            request.last_token_time = now
        for request in finished:
            request.finished_time = now
            live.pop(request.request_id, None)
            self.num_finished += 1
            for observer in observers:
                observer.on_finished(request, now)
            if records is not None:
                record = records.pop(request.request_id)
                record.finished_s = now
                record.num_output_tokens = len(request.output_token_ids)
                record.num_cached_tokens = request.num_cached_tokens
                record.num_preemptions = request.num_preemptions
                self.finished.append(record)
        record_it = IterationRecord(
            start=start, duration_s=now - start, num_prefill_tokens=output.num_prefill_tokens,
            num_decode_tokens=output.num_decode_tokens, token_budget=output.token_budget,
            max_num_seqs=self.config.tuning.max_num_seqs, num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_partial_prefills=sum(1 for c in output.chunks if c.is_prefill and not c.samples),
            kv_usage=self.kv_cache.usage, num_preempted=len(output.preempted))
        for observer in observers:
            observer.on_iteration(record_it)
        return True
