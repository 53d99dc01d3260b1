"""Run a workload through one simulated replica under a scheduling policy; per-request and summary figures.

Policies (the comparisons of Sarathi-Serve's evaluation):
- prefill-priority: no chunking, whole prompts first while running decodes pause (vLLM before chunking);
- decode-priority: no mixing, prompts only when no decode runs (request-level batching);
- stall-free: Sarathi-Serve with a fixed token budget;
- stall-free-time: stall-free with chunks cut by the cost model to a per-iteration time target.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from stallfree.contracts import Ceilings, Tuning, min_budget_for
from stallfree.node_daemon.sim.backend import build_cost_model, sim_num_kv_blocks
from stallfree.simulator.baseline_schedulers import PolicyConfig
from stallfree.simulator.latency_summary import SLOs, summarize
from stallfree.simulator.virtual_replica import RequestRecord, VirtualReplica
from stallfree.simulator.workload import RequestSpec, prompt_token_ids

POLICIES: dict[str, str] = {
    "prefill-priority": "prefill_priority",
    "decode-priority": "decode_priority",
    "stall-free": "stall_free",
    "stall-free-time": "stall_free",
}


@dataclass
class SimSetup:
    """Model, device and engine settings of one simulated replica."""

    model: str = "llama-3-8b"
    hardware: str = "h100"
    dtype: str = "bfloat16"
    tflops: float | None = None
    hbm_tbps: float | None = None
    overhead_ms: float | None = None
    policy: str = "stall-free"
    token_budget: int = 512
    max_num_seqs: int = 128
    max_partial_prefills: int = 1
    long_prefill_threshold: int = 0
    iteration_time_target_ms: float | None = None  # stall-free-time only
    max_token_budget: int | None = None  # ceiling; default: large enough for the budget (and 8K for time targets)
    max_model_len: int = 8192
    block_size: int = 16
    kv_memory_fraction: float = 0.9
    num_kv_blocks: int | None = None  # None: size from device memory after the weights
    enable_prefix_caching: bool = True

    def check(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.policy == "stall-free-time" and not self.iteration_time_target_ms:
            raise ValueError("policy stall-free-time needs an iteration time target (--iteration-time-target-ms)")

    def tuning(self) -> Tuning:
        budget = self.token_budget
        if self.policy == "stall-free-time":
            budget = self.ceilings().max_token_budget  # the time target cuts the chunks
        # The baselines ignore the budget for prompts; keep it valid beside max_num_seqs.
        if self.policy in ("prefill-priority", "decode-priority"):
            budget = max(budget, min_budget_for(self.max_num_seqs))
        return Tuning(budget, self.max_num_seqs, self.max_partial_prefills, self.long_prefill_threshold)

    def ceilings(self) -> Ceilings:
        floor = min_budget_for(self.max_num_seqs)
        default = 8192 if self.policy == "stall-free-time" else max(self.token_budget, floor)
        return Ceilings(self.max_token_budget or default, self.max_num_seqs)

    def scheduler_config(self) -> PolicyConfig:
        return PolicyConfig(
            ceilings=self.ceilings(), tuning=self.tuning(), max_model_len=self.max_model_len,
            policy=POLICIES[self.policy],
            iteration_time_target_ms=self.iteration_time_target_ms if self.policy == "stall-free-time" else None,
        )

    def build_replica(self, **kwargs: Any) -> VirtualReplica:
        self.check()
        cost = build_cost_model(self.model, self.hardware, self.dtype, tflops=self.tflops, hbm_tbps=self.hbm_tbps,
                                overhead_ms=self.overhead_ms)
        num_blocks = self.num_kv_blocks or sim_num_kv_blocks(cost, self.block_size, self.kv_memory_fraction)
        return VirtualReplica(cost, self.scheduler_config(), num_kv_blocks=num_blocks, block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching, **kwargs)

    def describe(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SimResult:
    setup: dict[str, Any]
    summary: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)  # every inter-token gap (for plots)
    timeline: list[tuple[float, int, int, float]] = field(default_factory=list)  # (t, prefill, decode, ms)

    def to_dict(self, per_request: bool = True) -> dict[str, Any]:
        out = {"setup": self.setup, "summary": self.summary}
        if per_request:
            out["requests"] = self.requests
        return out


class _IterationLog:
    """EngineObserver that keeps (start, prefill tokens, decode tokens, ms) of every iteration."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int, int, float]] = []

    def on_iteration(self, record) -> None:
        self.rows.append((record.start, record.num_prefill_tokens, record.num_decode_tokens, record.duration_s * 1000))

    def on_token(self, request, now, first) -> None:
        pass

    def on_finished(self, request, now) -> None:
        pass


def simulate(requests: list[RequestSpec], setup: SimSetup, slos: SLOs = SLOs(),
             time_limit_s: float = float("inf"), keep_timeline: bool = False) -> SimResult:
    """Serve `requests` on one replica in virtual time until all finish (or `time_limit_s` passes)."""
    log = _IterationLog() if keep_timeline else None
    replica = setup.build_replica(keep_records=True, observer=log)
    for index, request in enumerate(requests):
        if request.prompt_len + request.output_len > setup.max_model_len:
            raise ValueError(f"request {index}: prompt {request.prompt_len} + output {request.output_len} exceeds "
                             f"max_model_len {setup.max_model_len}")
        replica.submit(request.prompt_len, request.output_len, arrival_time=request.arrival_s,
                       prompt_token_ids=prompt_token_ids(request, index, 0, 256), request_id=f"req-{index}")
    replica.run_until_idle(limit_s=time_limit_s)
    return summarize_run(replica, requests, setup, slos, log)


def summarize_run(replica: VirtualReplica, requests: list[RequestSpec], setup: SimSetup, slos: SLOs,
                  log: _IterationLog | None = None) -> SimResult:
    records = sorted(replica.finished, key=lambda r: r.arrival_s)
    rows = [_request_row(r, slos) for r in records]
    itl_ms = [gap * 1000 for r in records for gap in r.itl_s]
    first_arrival = requests[0].arrival_s if requests else 0.0
    last_finish = max((r.finished_s for r in records), default=first_arrival)
    duration = max(1e-9, last_finish - first_arrival)
    output_tokens = sum(r.num_output_tokens for r in records)
    good = sum(1 for row in rows if row["slo_met"])
    summary = {
        "num_requests": len(requests),
        "completed": len(records),
        "duration_s": duration,
        "request_throughput": len(records) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_len for r in records)) / duration,
        "ttft_ms": summarize(row["ttft_ms"] for row in rows),
        "tpot_ms": summarize(row["tpot_ms"] for row in rows if row["tpot_ms"] is not None),
        "itl_ms": summarize(itl_ms),
        "queue_wait_ms": summarize(row["queue_wait_ms"] for row in rows),
        "e2e_ms": summarize(row["e2e_ms"] for row in rows),
        "slos": slos.to_dict(),
        "slo_attainment": good / len(records) if records else 0.0,
        "goodput": good / duration,
        "preemptions": replica.scheduler.num_preemptions,
        "iterations": replica.num_iterations,
        "mean_iteration_ms": replica.busy_s / replica.num_iterations * 1000 if replica.num_iterations else None,
        "busy_fraction": replica.busy_s / duration,
    }
    return SimResult(setup.describe(), summary, rows, itl_ms, log.rows if log else [])


def _request_row(record: RequestRecord, slos: SLOs) -> dict[str, Any]:
    ttft = record.ttft_s * 1000
    tpot = record.tpot_s * 1000 if record.tpot_s is not None else None
    e2e = (record.finished_s - record.arrival_s) * 1000
    return {
        "id": record.request_id,
        "arrival_s": record.arrival_s,
        "prompt_len": record.prompt_len,
        "output_len": record.num_output_tokens,
        "queue_wait_ms": record.queue_wait_s * 1000,
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "max_itl_ms": max(record.itl_s) * 1000 if record.itl_s else None,
        "e2e_ms": e2e,
        "cached_tokens": record.num_cached_tokens,
        "preemptions": record.num_preemptions,
        "slo_met": slos.met(ttft, tpot, e2e),
    }
