"""One serving replica in virtual time: the daemon's own engine loop (LLMEngine) on the sim executor.

What a closed-loop control run, `stallfree simulate` and capacity searches drive instead of a daemon.
The iteration is `LLMEngine.step()` itself (scheduler, KV cache manager, time stamps, observers, stats
window), with the SimExecutor advancing a virtual clock by the cost model's time instead of sleeping:
`stallfree serve --backend sim` runs the same step in real time. This file only adds what the HTTP
side of a daemon would: arrivals at their (virtual) time, and the loop that runs iterations back to
back while there is work and jumps idle gaps.

`window_stats` answers exactly what a daemon's /admin/stats would (the daemon's own StatsWindow, fed
on the virtual clock); `set_tuning` is the live PUT. Timestamps are the engine's: a token is produced
at the end of its iteration, queue wait runs from arrival to the first iteration that schedules the
request, TPOT is per finished request.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from functools import partial

from stallfree import latency
from stallfree.contracts import Ceilings, Profile, Tuning, WindowStats, validate_tuning
from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stallfree.node_daemon.engine.engine import LLMEngine
from stallfree.node_daemon.engine.engine_protocol import EngineObserver
from stallfree.node_daemon.engine.observers import FanoutObserver
from stallfree.node_daemon.engine.request import Objective, Request, RequestStatus
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.measure.stats_window import StatsWindow
from stallfree.node_daemon.sim.backend import build_cost_model, sim_num_kv_blocks, sim_tokenizer
from stallfree.node_daemon.sim.cost_model import IterationCostModel, ProfileCostModel, RooflineCostModel
from stallfree.node_daemon.sim.sim_executor import SimExecutor, VirtualClock
from stallfree.simulator.baseline_schedulers import PolicyConfig, build_scheduler

# Vocabulary of a replica whose cost model names no model shape (a measured profile): the byte-level
# tokenizer's bytes and specials fit, and so do the simulator's prompt tokens.
_PROFILE_VOCAB = 512
_BYTES = list(range(256))


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
        return None if self.first_token_s is None else latency.ttft_s(self.arrival_s, self.first_token_s)

    @property
    def queue_wait_s(self) -> float | None:
        return latency.queue_wait_s(self.arrival_s, self.first_scheduled_s)

    @property
    def tpot_s(self) -> float | None:
        return latency.tpot_s(self.first_token_s, self.finished_s, self.num_output_tokens)


class _RecordKeeper:
    """EngineObserver that writes each request's timeline into a RequestRecord (aborted ones are dropped)."""

    def __init__(self) -> None:
        self.live: dict[str, RequestRecord] = {}
        self.finished: list[RequestRecord] = []

    def on_iteration(self, record) -> None:
        pass

    def on_token(self, request: Request, now: float, first: bool) -> None:
        record = self.live.get(request.request_id)
        if record is None:
            return
        if first:
            record.first_scheduled_s = request.first_scheduled_time
            record.first_token_s = now
        else:
            record.itl_s.append(now - request.last_token_time)  # the engine updates it after the observers

    def on_finished(self, request: Request, now: float) -> None:
        record = self.live.pop(request.request_id, None)
        if record is None or request.status is RequestStatus.FINISHED_ABORTED:
            return
        record.finished_s = now
        record.num_output_tokens = len(request.output_token_ids)
        record.num_cached_tokens = request.num_cached_tokens
        record.num_preemptions = request.num_preemptions
        self.finished.append(record)


def observer_of(observers: list[EngineObserver]) -> EngineObserver:
    """The engine's one observer slot: a lone observer is called directly (one call fewer per token)."""
    return observers[0] if len(observers) == 1 else FanoutObserver(*observers)


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
        config = scheduler_config or SchedulerConfig()
        validate_tuning(config.tuning, config.ceilings)
        self.clock = VirtualClock(start_time)
        shape = getattr(cost_model, "shape", None)
        vocab_size = shape.vocab_size if shape is not None else _PROFILE_VOCAB
        self.executor = SimExecutor(cost_model, clock=self.clock, vocab_size=vocab_size)
        # One daemon StatsWindow per window length asked for at construction (definitions as /admin/stats).
        lengths = (stats_window_s,) if isinstance(stats_window_s, (int, float)) else tuple(stats_window_s)
        self.stats_window_s = float(lengths[0])
        self._windows: dict[float, StatsWindow] = {float(w): StatsWindow(w, clock=self.clock) for w in lengths}
        self.keep_records = keep_records
        self._records = _RecordKeeper() if keep_records else None
        observers: list[EngineObserver] = list(self._windows.values())
        if self._records is not None:
            observers.append(self._records)
        if observer is not None:
            observers.append(observer)
        engine_config = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                                                       enable_prefix_caching=enable_prefix_caching),
                                     scheduler=config, backend="sim")
        # No text: the placeholder tokens' detokenization would be the costliest part of a simulated token.
        self.engine = LLMEngine(engine_config, self.executor, sim_tokenizer(vocab_size), observer_of(observers),
                                make_scheduler=partial(build_scheduler, cost_model=cost_model), clock=self.clock,
                                detokenize=False)
        self.config = self.engine.scheduler.config
        self.scheduler = self.engine.scheduler
        self.kv_cache = self.engine.kv_cache
        self._arrivals: list[tuple[float, int, str, list[int], int, Objective | None]] = []  # heap: not yet arrived
        self._seq = itertools.count()
        self.num_submitted = 0
        self._num_aborted = 0

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
        config = PolicyConfig(ceilings=ceilings or Ceilings(), tuning=tuning or Tuning(),
                              max_model_len=max_model_len, policy=policy,
                              iteration_time_target_ms=iteration_time_target_ms)
        num_blocks = sim_num_kv_blocks(cost_model, block_size, kv_memory_fraction)
        return cls(cost_model, config, num_kv_blocks=num_blocks, block_size=block_size, **kwargs)

    # ---- driving ---------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.clock.now

    def submit(self, prompt_len: int, max_tokens: int, arrival_time: float | None = None,
               prompt_token_ids: list[int] | None = None, request_id: str | None = None,
               objective: Objective | None = None) -> str:
        """Queue a request arriving at `arrival_time` (default: now); returns its id. `objective`: what the router
        signed for it (its priority and deadline order it in the engine's waiting queue)."""
        if prompt_token_ids is None:
            if prompt_len < 1:
                raise ValueError(f"prompt_len must be at least 1, got {prompt_len}")
            # Distinct leading tokens per request: no accidental prefix-cache hits between requests.
            n = self.num_submitted
            start = n % 256
            rest = (_BYTES[start:] + _BYTES[:start]) * (prompt_len // 256 + 1)  # (n + k) % 256 for k = 0, 1, ...
            prompt_token_ids = ([n % 251, (n // 251) % 251, (n // 63001) % 251] + rest[:max(0, prompt_len - 3)])
            prompt_token_ids = prompt_token_ids[:prompt_len]
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        max_model_len = self.engine.max_model_len
        if len(prompt_token_ids) + max_tokens > max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)}) plus max_tokens ({max_tokens}) exceeds "
                             f"max_model_len {max_model_len}")
        arrival = self.clock.now if arrival_time is None else arrival_time
        request_id = request_id or f"{self.name}-{self.num_submitted}"
        heapq.heappush(self._arrivals, (arrival, next(self._seq), request_id, prompt_token_ids, max_tokens, objective))
        self.num_submitted += 1
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort a request that arrived (a not yet arrived one is dropped from the queue)."""
        for i, arrival in enumerate(self._arrivals):
            if arrival[2] == request_id:
                self._arrivals.pop(i)
                heapq.heapify(self._arrivals)
                self._num_aborted += 1
                return True
        if self.engine.abort_request(request_id) is None:
            return False
        self._num_aborted += 1
        return True

    def advance_to(self, t: float) -> None:
        """Run until virtual time `t`: iterations back to back while there is work, idle gaps skipped.

        An iteration that starts before `t` finishes after it, as on a real device; the clock may overshoot.
        """
        clock, engine, arrivals = self.clock, self.engine, self._arrivals
        while True:
            if arrivals and arrivals[0][0] <= clock.now:
                self._admit_arrivals()
            if clock.now < t and engine.has_unfinished():
                before = engine.num_iterations
                engine.step()
                if engine.num_iterations != before:
                    continue
            next_arrival = arrivals[0][0] if arrivals else None
            if next_arrival is None or next_arrival > t:
                if clock.now < t:
                    clock.now = t
                return
            if next_arrival > clock.now:
                clock.now = next_arrival

    def run_until_idle(self, limit_s: float = float("inf")) -> None:
        """Advance until every submitted request finished (or `limit_s` of virtual time)."""
        while (self._arrivals or self.engine.has_unfinished()) and self.clock.now < limit_s:
            horizon = self._arrivals[-1][0] if self._arrivals else self.clock.now
            self.advance_to(min(limit_s, max(horizon, self.clock.now) + 60.0))

    def set_tuning(self, tuning: Tuning) -> None:
        """The live PUT /admin/tuning: validated against the ceilings, applied from the next iteration."""
        validate_tuning(tuning, self.config.ceilings)
        self.engine.set_tuning(tuning)

    # ---- observing -------------------------------------------------------------------------

    @property
    def tuning(self) -> Tuning:
        return self.engine.get_tuning()

    @property
    def ceilings(self) -> Ceilings:
        return self.engine.ceilings

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
    def num_iterations(self) -> int:
        return self.engine.num_iterations

    @property
    def busy_s(self) -> float:
        """Virtual seconds spent in iterations."""
        return self.executor.busy_s

    @property
    def num_finished(self) -> int:
        """Requests that ran to their end (aborted ones are not counted)."""
        return self.num_submitted - len(self._arrivals) - self.engine.num_unfinished - self._num_aborted

    @property
    def kv_usage(self) -> float:
        return self.kv_cache.usage

    @property
    def records(self) -> dict[str, RequestRecord]:
        """Records of requests that arrived and have not finished (keep_records only)."""
        return self._records.live if self._records is not None else {}

    @property
    def finished(self) -> list[RequestRecord]:
        """Records of finished requests in finishing order (keep_records only; aborted ones are left out)."""
        return self._records.finished if self._records is not None else []

    def window_stats(self, now: float | None = None, window_s: float | None = None) -> WindowStats:
        """/admin/stats of this replica over the last `window_s` virtual seconds (exact percentiles).

        `window_s` must be one of the lengths given as `stats_window_s` (default: the first of them).
        """
        window = self._windows.get(float(window_s or self.stats_window_s))
        if window is None:
            raise ValueError(f"replica {self.name!r} keeps stats windows of {sorted(self._windows)} s, not {window_s}: "
                             f"pass the length as stats_window_s")
        return window.snapshot(
            self.tuning, self.ceilings, now=self.clock.now if now is None else now,
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
        """Hand every request whose arrival time has come to the engine, as a daemon's HTTP side would."""
        arrivals, now, engine = self._arrivals, self.clock.now, self.engine
        records = self._records.live if self._records is not None else None
        while arrivals and arrivals[0][0] <= now:
            arrival, _, request_id, token_ids, max_tokens, objective = heapq.heappop(arrivals)
            for window in self._windows.values():
                window.on_arrival(len(token_ids), arrival)
            engine.add_request(request_id, prompt_token_ids=token_ids,
                               sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=arrival,
                               objective=objective)
            if records is not None:
                records[request_id] = RequestRecord(request_id, arrival, len(token_ids), max_tokens)
