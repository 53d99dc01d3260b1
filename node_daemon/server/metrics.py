"""Prometheus metrics of one daemon, fed by the engine loop as an EngineObserver.

Every series is named `stallfree_*` and carries a `model_name` label (vLLM's name, so its dashboards port).
Latency histograms have buckets below 10 ms because TPOT SLOs are set in milliseconds; control decisions
still use the exact percentiles of measure/stats_window.py, never these buckets. Label children are resolved once
here so the per-token path is a single observe() with no label lookup.

The occupancy gauges (running, waiting, partial prefills, KV usage and reservation) are read from the
engine when Prometheus scrapes (`bind_live`), so they are true at once when requests end between iterations
(abort, error, drain), not only at the next iteration. A request that failed is not a success: it is
counted once, as an error, by the server that answered it.

Goodput, per objective (the one the router signed, engine/request.py `Objective`; `default` without one): every
request the engine finished counts in stallfree_objective_finished_requests, and those that met every SLO of their
objective also in stallfree_objective_goodput_requests. Met: it ran to its end (stop or length: an abort, an error or
a grammar's dead end is not served), its first token came by its deadline (TTFT from the router's arrival, the
router's queue wait included) and its mean TPOT is within its TPOT target, each when the objective has one.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from stallfree import latency
from stallfree.contracts import Tuning
from stallfree.node_daemon.engine.engine_protocol import IterationRecord
from stallfree.node_daemon.engine.request import Request, RequestStatus

# Per-token and per-iteration times (seconds): fine steps from 1 ms up to a few seconds of stall.
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1,
    0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
# Per-request times (seconds): TTFT, queue time, prefill, decode and end-to-end latency.
REQUEST_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
    5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)
# Tokens per iteration: powers of two, so a budget that is one shows as a bucket edge.
ITERATION_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(0, 17))
# Tokens per request (prompt, generation): 1, 2, 5 per decade up to a million, as vLLM's.
REQUEST_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(0, 6) for m in (1, 2, 5)) + (1e6,)
SPEC_ACCEPTANCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

FINISH_REASONS = ("stop", "length", "abort", "grammar_dead_end")
ERROR_REASONS = (
    "invalid_request", "validation", "not_found", "too_large", "unauthorized", "queue_full", "draining",
    "starting", "engine", "internal", "timeout",
)
LABEL = "model_name"
DEFAULT_OBJECTIVE = "default"  # a request without an objective (the router's implicit objective has this name too)
_SERVED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH})


def met_objective(request: Request) -> bool:
    """Whether a finished request met every SLO of its objective (see the module's docstring)."""
    if request.status not in _SERVED:
        return False
    objective = request.objective
    if objective is None:
        return True
    if objective.deadline is not None and (request.first_token_time is None
                                           or request.first_token_time > objective.deadline):
        return False
    if objective.tpot_target_ms is not None:
        tpot = latency.tpot_s(request.first_token_time, request.last_token_time, request.num_output_tokens)
        if tpot is not None and tpot * 1000.0 > objective.tpot_target_ms:
            return False
    return True


class EngineMetrics:
    """The daemon's Prometheus series; register once per process (or per test with its own registry)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg, m = self.registry, [model_name]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, [LABEL], buckets=buckets, registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, [LABEL], registry=reg)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, [LABEL], registry=reg)

        self.ttft = hist("stallfree_time_to_first_token_seconds", "Arrival to first output token.",
                         REQUEST_LATENCY_BUCKETS).labels(*m)
        self.tpot = hist("stallfree_time_per_output_token_seconds",
                         "Per request: (last token - first token) / (output tokens - 1).",
                         TOKEN_LATENCY_BUCKETS).labels(*m)
        self.itl = hist("stallfree_inter_token_latency_seconds", "Gap between consecutive tokens of a request.",
                        TOKEN_LATENCY_BUCKETS).labels(*m)
        self.queue_time = hist("stallfree_request_queue_time_seconds", "Arrival to first scheduled.",
                               REQUEST_LATENCY_BUCKETS).labels(*m)
        self.prefill_time = hist("stallfree_request_prefill_time_seconds", "First scheduled to first token.",
                                 REQUEST_LATENCY_BUCKETS).labels(*m)
        self.decode_time = hist("stallfree_request_decode_time_seconds", "First token to finish.",
                                REQUEST_LATENCY_BUCKETS).labels(*m)
        self.e2e = hist("stallfree_e2e_request_latency_seconds", "Arrival to finish.",
                        REQUEST_LATENCY_BUCKETS).labels(*m)
        self.iteration_time = hist("stallfree_iteration_time_seconds", "Wall time of one engine iteration.",
                                   TOKEN_LATENCY_BUCKETS).labels(*m)
        self.iteration_tokens = hist("stallfree_iteration_tokens", "Tokens scheduled per iteration (all).",
                                     ITERATION_TOKEN_BUCKETS).labels(*m)
        self.iteration_prefill_tokens = hist("stallfree_iteration_prefill_tokens",
                                             "Prefill tokens scheduled per iteration.",
                                             ITERATION_TOKEN_BUCKETS).labels(*m)
        self.iteration_decode_tokens = hist("stallfree_iteration_decode_tokens",
                                            "Decode tokens scheduled per iteration.",
                                            ITERATION_TOKEN_BUCKETS).labels(*m)
        self.request_prompt_tokens = hist("stallfree_request_prompt_tokens", "Prompt tokens per finished request.",
                                          REQUEST_TOKEN_BUCKETS).labels(*m)
        self.request_generation_tokens = hist("stallfree_request_generation_tokens",
                                              "Output tokens per finished request.", REQUEST_TOKEN_BUCKETS).labels(*m)

        self.num_running = gauge("stallfree_num_requests_running", "Requests in the running batch.").labels(*m)
        self.num_waiting = gauge("stallfree_num_requests_waiting", "Requests waiting to be scheduled.").labels(*m)
        self.num_partial_prefills = gauge("stallfree_num_partial_prefills",
                                          "Requests whose prompt is partly prefilled.").labels(*m)
        self.kv_usage = gauge("stallfree_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1).").labels(*m)
        self.kv_reserved = gauge("stallfree_kv_cache_reserved_ratio",
                                 "Fraction of KV blocks held or reserved by running requests (by output "
                                 "estimate; above 1 when estimates ran short).").labels(*m)
        self.token_budget = gauge("stallfree_token_budget", "Live token budget per iteration.").labels(*m)
        self.max_num_seqs = gauge("stallfree_max_num_seqs", "Live cap on running requests.").labels(*m)
        self.max_partial_prefills = gauge("stallfree_max_partial_prefills",
                                          "Live cap on concurrent partial prefills.").labels(*m)
        self.long_prefill_threshold = gauge("stallfree_long_prefill_threshold",
                                            "Live per-request prefill cap per iteration (0 = none).").labels(*m)

        self.iterations = counter("stallfree_iterations", "Engine iterations run.").labels(*m)
        self.preemptions = counter("stallfree_preemptions", "Requests preempted (KV freed, recomputed later).").labels(*m)
        self.prompt_tokens = counter("stallfree_prompt_tokens", "Prompt tokens of requests that started.").labels(*m)
        self.generation_tokens = counter("stallfree_generation_tokens", "Output tokens generated.").labels(*m)
        self.kv_evictions = counter("stallfree_kv_cache_evictions",
                                    "Cached KV blocks evicted to make room (prefix-cache content lost).").labels(*m)
        self.prefill_tokens = counter("stallfree_prefill_tokens_computed",
                                      "Prefill tokens computed (chunks, recompute included).").labels(*m)
        self.prefix_cache_queries = counter("stallfree_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.").labels(*m)
        self.prefix_cache_hits = counter("stallfree_prefix_cache_hits",
                                         "Prompt tokens served from the prefix cache.").labels(*m)
        self.spec_draft_tokens = counter("stallfree_spec_draft_tokens",
                                         "Speculation: n-gram draft tokens verified.").labels(*m)
        self.spec_accepted_tokens = counter("stallfree_spec_accepted_tokens",
                                            "Speculation: draft tokens accepted (output tokens).").labels(*m)
        self.spec_rejected_tokens = counter("stallfree_spec_rejected_tokens",
                                            "Speculation: draft tokens rejected (their rows computed in vain).").labels(*m)
        self.request_spec_acceptance = hist("stallfree_request_spec_acceptance_ratio",
                                            "Per finished request that drafted: accepted / drafted tokens.",
                                            SPEC_ACCEPTANCE_BUCKETS).labels(*m)
        success = Counter("stallfree_request_success", "Finished requests by finish reason.",
                          [LABEL, "finished_reason"], registry=reg)
        self._success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        errors = Counter("stallfree_request_errors", "Refused or failed requests by reason.",
                         [LABEL, "reason"], registry=reg)
        self._errors_family, self._model = errors, model_name
        self._errors = {reason: errors.labels(model_name, reason) for reason in ERROR_REASONS}
        observer_errors = Counter("stallfree_observer_errors", "Faults of the engine's observers (metrics, "
                                  "stats) by hook; the requests are served regardless.", [LABEL, "hook"], registry=reg)
        self._observer_errors = {hook: observer_errors.labels(model_name, hook)
                                 for hook in ("on_iteration", "on_token", "on_finished")}
        self._objective_finished = Counter(
            "stallfree_objective_finished_requests", "Requests the engine finished (any way), by objective "
            "(`default`: none).", [LABEL, "objective"], registry=reg)
        self._objective_goodput = Counter(
            "stallfree_objective_goodput_requests", "Finished requests that met every SLO of their objective: "
            "served to the end, first token by the deadline, mean TPOT within the target.", [LABEL, "objective"],
            registry=reg)
        # The latencies per objective too: the alerts judge each objective against its own targets.
        self._objective_latency = tuple(
            Histogram(f"stallfree_objective_{name}", f"{doc} By objective (`default`: none).", [LABEL, "objective"],
                      buckets=buckets, registry=reg)
            for name, doc, buckets in (
                ("time_to_first_token_seconds", "Arrival to first output token.", REQUEST_LATENCY_BUCKETS),
                ("time_per_output_token_seconds", "Per request: mean time per output token after the first.",
                 TOKEN_LATENCY_BUCKETS),
                ("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS)))
        self._objective_children: dict[str, tuple] = {}
        self.engine_config = Info("stallfree_engine_config", "The engine's configuration: ceilings, KV cache, "
                                  "dtype, backend (set once the engine runs).", [LABEL], registry=reg).labels(*m)
        self._slow_path = Gauge("stallfree_slow_path", "1 for each part served on a slower path than the compiled "
                                "forward over the file's codes (models/serving_paths.py); none: the fast path.",
                                [LABEL, "path"], registry=reg)
        self._model_name = model_name
        self.slow_paths: tuple[str, ...] = ()  # what /admin/stats reports to the operator
        self._live = False

    def bind_live(self, counts: Callable[[], object | None]) -> None:
        """Read the occupancy gauges from `counts()` (a LiveCounts, or None before the engine runs) at scrape."""

        def read(name: str) -> Callable[[], float]:
            def value() -> float:
                live = counts()
                return 0.0 if live is None else float(getattr(live, name))
            return value

        self.num_running.set_function(read("num_running"))
        self.num_waiting.set_function(read("num_waiting"))
        self.num_partial_prefills.set_function(read("num_partial_prefills"))
        self.kv_usage.set_function(read("kv_usage"))
        self.kv_reserved.set_function(read("kv_reserved"))
        self._live = True

    def set_engine_config(self, config: dict[str, object]) -> None:
        self.engine_config.info({key: str(value) for key, value in config.items()})

    def set_slow_paths(self, paths: list[str]) -> None:
        """Replace the slow-path series (start-up, and again once a background compile has loaded)."""
        self._slow_path.clear()
        for path in paths:
            self._slow_path.labels(self._model_name, path).set(1)
        self.slow_paths = tuple(paths)

    # --- EngineObserver (engine thread) ---

    def on_iteration(self, record: IterationRecord) -> None:
        self.iterations.inc()
        self.iteration_time.observe(record.duration_s)
        self.iteration_tokens.observe(record.num_prefill_tokens + record.num_decode_tokens + record.num_verify_tokens)
        self.iteration_prefill_tokens.observe(record.num_prefill_tokens)
        self.iteration_decode_tokens.observe(record.num_decode_tokens)
        if record.num_prefill_tokens:
            self.prefill_tokens.inc(record.num_prefill_tokens)
        if record.num_preempted:
            self.preemptions.inc(record.num_preempted)
        if record.num_verify_tokens:
            self.spec_draft_tokens.inc(record.num_verify_tokens)
            self.spec_accepted_tokens.inc(record.num_accepted_tokens)
            self.spec_rejected_tokens.inc(record.num_verify_tokens - record.num_accepted_tokens)
        if not self._live:
            self.num_running.set(record.num_running)
            self.num_waiting.set(record.num_waiting)
            self.num_partial_prefills.set(record.num_partial_prefills)
            self.kv_usage.set(record.kv_usage)
            self.kv_reserved.set(record.kv_reserved)
        if record.num_evicted_blocks:
            self.kv_evictions.inc(record.num_evicted_blocks)
        self.token_budget.set(record.token_budget)
        self.max_num_seqs.set(record.max_num_seqs)

    def on_token(self, request: Request, now: float, first: bool) -> None:
        self.generation_tokens.inc()
        if first:
            ttft = latency.ttft_s(request.arrival_time, now)
            self.ttft.observe(ttft)
            self._of_objective(request)[2].observe(ttft)
            self.prompt_tokens.inc(request.num_prompt_tokens)
            self.prefix_cache_queries.inc(request.num_prompt_tokens)
            if request.num_cached_tokens:
                self.prefix_cache_hits.inc(request.num_cached_tokens)
            queue_wait = latency.queue_wait_s(request.arrival_time, request.first_scheduled_time)
            if queue_wait is not None:
                self.queue_time.observe(queue_wait)
                self._of_objective(request)[4].observe(queue_wait)
                self.prefill_time.observe(now - request.first_scheduled_time)
        elif request.last_token_time is not None:
            # The engine updates last_token_time after notifying observers: it still holds the previous token.
            self.itl.observe(latency.itl_s(request.last_token_time, now))

    def on_finished(self, request: Request, now: float) -> None:
        self._count_goodput(request)
        counter = self._success.get(request.status.value)
        if counter is None:
            return  # failed ("error"): the server counts it once in stallfree_request_errors
        counter.inc()
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_output_tokens)
        if request.num_drafted_tokens:
            self.request_spec_acceptance.observe(request.num_accepted_tokens / request.num_drafted_tokens)
        self.e2e.observe(now - request.arrival_time)
        if request.first_token_time is not None:
            self.decode_time.observe(now - request.first_token_time)
            tpot = latency.tpot_s(request.first_token_time, request.last_token_time, request.num_output_tokens)
            if tpot is not None:
                self.tpot.observe(tpot)
                self._of_objective(request)[3].observe(tpot)

    def _of_objective(self, request: Request) -> tuple:
        """The request's objective's series: finished, goodput, TTFT, TPOT, queue time."""
        name = DEFAULT_OBJECTIVE if request.objective is None else request.objective.name
        children = self._objective_children.get(name)
        if children is None:
            children = self._objective_children[name] = (
                self._objective_finished.labels(self._model, name), self._objective_goodput.labels(self._model, name),
                *(family.labels(self._model, name) for family in self._objective_latency))
        return children

    def _count_goodput(self, request: Request) -> None:
        children = self._of_objective(request)
        children[0].inc()
        if met_objective(request):
            children[1].inc()

    # --- server side (HTTP event loop) ---

    def record_error(self, reason: str) -> None:
        child = self._errors.get(reason)
        if child is None:
            child = self._errors[reason] = self._errors_family.labels(self._model, reason)
        child.inc()

    def record_observer_error(self, hook: str) -> None:
        """An observer raised in `hook` (engine thread): the engine logged it, this counts it."""
        child = self._observer_errors.get(hook)
        if child is not None:
            child.inc()

    def set_tuning(self, tuning: Tuning) -> None:
        """Show a new tuning at once (iterations keep the budget gauges current afterwards)."""
        self.token_budget.set(tuning.token_budget)
        self.max_num_seqs.set(tuning.max_num_seqs)
        self.max_partial_prefills.set(tuning.max_partial_prefills)
        self.long_prefill_threshold.set(tuning.long_prefill_threshold)
