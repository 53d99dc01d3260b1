"""Observe replicas through Prometheus instead of their admin API (where a user sets it up that way).

Each control step runs one PromQL query per figure over the `stallfree_` series of every replica at
once (`by (pod)`), through Prometheus' HTTP API, and builds each replica's WindowStats from them:
percentiles by histogram_quantile over the daemons' buckets (coarser than the admin API's exact window
percentiles, which is why that is the default), rates and counts by rate()/increase(), the live knobs
from their gauges. A replica Prometheus cannot scrape (up == 0), has no series for, or whose window
holds too few samples is unknown, as with the admin API. Prometheus holds no profile: the tuner then
sizes its steps without one.

Demand is what arrived, as the admin API reports it, not what was served: the daemon exports no counter of
arrived prompt tokens, so it is rebuilt from what it does export (`arrived_demand`).
"""
from __future__ import annotations

import asyncio
from typing import Sequence

import httpx

from stallfree.contracts import Ceilings, Percentiles, Tuning, WindowStats
from stallfree.operator.control.observe import NOT_READY, ReplicaObservation, ReplicaTarget, classify

HISTOGRAMS = {
    "ttft_ms": "stallfree_time_to_first_token_seconds",
    "tpot_ms": "stallfree_time_per_output_token_seconds",
    "itl_ms": "stallfree_inter_token_latency_seconds",
    "queue_wait_ms": "stallfree_request_queue_time_seconds",
}
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
# stallfree_request_errors reasons of requests the engine took and failed (request_rate counts them with the
# finished ones, as the admin API does), and of requests refused for load (demand all the same).
FAILED_REASONS = "engine|internal"
REFUSED_REASONS = "queue_full|draining"


def arrived_demand(ended_per_s: float, refused_per_s: float, in_engine_change: float, window_s: float,
                   started_prompt_tokens_per_s: float, started_per_s: float,
                   lifetime_mean_prompt: float | None) -> tuple[float, float]:
    """(requests, prompt tokens) per second that arrived in the window.

    Requests are conserved: what arrived either ended (finished or failed), was refused, or is still waiting or
    running, so arrivals = ended + refused + the change in waiting + running. Their prompt tokens are that times the mean
    prompt of the requests that started in the window (the lifetime mean when none did). Served prompt tokens,
    counted at the first token, cannot exceed what the replica computes: under overload they are its throughput,
    not its demand."""
    arrived = max(0.0, ended_per_s + refused_per_s + in_engine_change / window_s)
    if started_per_s > 0:
        mean_prompt: float | None = started_prompt_tokens_per_s / started_per_s
    else:
        mean_prompt = lifetime_mean_prompt
    if mean_prompt is None:
        return arrived, started_prompt_tokens_per_s
    return arrived, arrived * mean_prompt


def window_queries(selector: str, window_s: float, by: str) -> dict[str, str]:
    """Every PromQL query one step runs, by the figure it gives (one value per replica label)."""
    w = f"{max(1, int(round(window_s)))}s"

    def rate(metric: str, matcher: str = "") -> str:
        return f"sum by ({by}) (rate({metric}{{{_matchers(selector, matcher)}}}[{w}]))"

    def increase(metric: str) -> str:
        return f"sum by ({by}) (increase({metric}{{{selector}}}[{w}]))"

    def gauge(metric: str) -> str:
        return f"max by ({by}) ({metric}{{{selector}}})"

    def change(metric: str) -> str:
        return f"sum by ({by}) (delta({metric}{{{selector}}}[{w}]))"

    def total(metric: str) -> str:
        return f"sum by ({by}) ({metric}{{{selector}}})"

    queries: dict[str, str] = {}
    for field, metric in HISTOGRAMS.items():
        for name, q in QUANTILES.items():
            queries[f"{field}.{name}"] = (f"1000 * histogram_quantile({q}, sum by ({by}, le) "
                                          f"(rate({metric}_bucket{{{selector}}}[{w}])))")
        queries[f"{field}.count"] = increase(f"{metric}_count")
    queries.update({
        "up": f"min by ({by}) (up{{{selector}}})",
        "finished_per_s": rate("stallfree_request_success_total"),
        "failed_per_s": rate("stallfree_request_errors_total", f'reason=~"{FAILED_REASONS}"'),
        "refused_per_s": rate("stallfree_request_errors_total", f'reason=~"{REFUSED_REASONS}"'),
        "waiting_change": change("stallfree_num_requests_waiting"),
        "running_change": change("stallfree_num_requests_running"),
        "started_per_s": rate("stallfree_time_to_first_token_seconds_count"),
        "started_prompt_tokens_per_s": rate("stallfree_prompt_tokens_total"),
        "started_total": total("stallfree_time_to_first_token_seconds_count"),
        "started_prompt_tokens_total": total("stallfree_prompt_tokens_total"),
        "generation_tokens_per_s": rate("stallfree_generation_tokens_total"),
        "prefill_tokens_per_s": rate("stallfree_prefill_tokens_computed_total"),
        "decode_tokens_per_s": rate("stallfree_iteration_decode_tokens_sum"),
        "tokens_per_iteration": f"{rate('stallfree_iteration_tokens_sum')} / {rate('stallfree_iteration_tokens_count')}",
        "kv_usage": gauge("stallfree_kv_cache_usage_ratio"),
        "preemptions": increase("stallfree_preemptions_total"),
        "num_waiting": gauge("stallfree_num_requests_waiting"),
        "num_running": gauge("stallfree_num_requests_running"),
        "token_budget": gauge("stallfree_token_budget"),
        "max_num_seqs": gauge("stallfree_max_num_seqs"),
        "max_partial_prefills": gauge("stallfree_max_partial_prefills"),
        "long_prefill_threshold": gauge("stallfree_long_prefill_threshold"),
        "iterations": increase("stallfree_iterations_total"),
        "slow_paths": f"count by ({by}) (stallfree_slow_path{{{selector}}})",
        "mean_iteration_ms": (f"1000 * {rate('stallfree_iteration_time_seconds_sum')} / "
                              f"{rate('stallfree_iteration_time_seconds_count')}"),
    })
    return queries


def _slow_paths(count: int) -> tuple[str, ...]:
    """Prometheus gives how many stallfree_slow_path series a replica has; their `path` labels say which."""
    return (f"{count} slow path(s): the stallfree_slow_path series name them",) if count else ()


def _matchers(*parts: str) -> str:
    return ", ".join(p for p in parts if p)


class PrometheusObserver:
    def __init__(self, client: httpx.AsyncClient, base_url: str, selector: str, window_s: float,
                 ceilings: Ceilings, min_samples: int = 5, replica_label: str = "pod", timeout_s: float = 5.0) -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.window_s = window_s
        self.ceilings = ceilings
        self.min_samples = min_samples
        self.replica_label = replica_label
        self.timeout_s = timeout_s
        self.queries = window_queries(selector, window_s, replica_label)

    async def observe(self, targets: Sequence[ReplicaTarget], now: float) -> list[ReplicaObservation]:
        try:
            values = await self._query_all()
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            reason = f"Prometheus query failed: {exc}"
            return [classify(t, None, None, self.min_samples, NOT_READY if not t.ready else reason) for t in targets]
        return [self._observation(t, values) for t in targets]

    async def _query_all(self) -> dict[str, dict[str, float]]:
        names = list(self.queries)
        results = await asyncio.gather(*(self._query(self.queries[n]) for n in names))
        return dict(zip(names, results))

    async def _query(self, expr: str) -> dict[str, float]:
        """Instant query: {replica label value: number} (NaN, as histogram_quantile gives with no data, dropped)."""
        response = await self.client.get(f"{self.base_url}/api/v1/query", params={"query": expr},
                                         timeout=self.timeout_s)
        response.raise_for_status()
        body = response.json()
        if body.get("status") != "success":
            raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
        out = {}
        for item in body["data"]["result"]:
            value = float(item["value"][1])
            if value == value:  # not NaN
                out[item["metric"].get(self.replica_label, "")] = value
        return out

    def _observation(self, target: ReplicaTarget, values: dict[str, dict[str, float]]) -> ReplicaObservation:
        if not target.ready:
            return classify(target, None, None, self.min_samples, NOT_READY)
        name = target.name
        if values["up"].get(name) == 0:
            return classify(target, None, None, self.min_samples, "scrape failed (up == 0 in Prometheus)")
        if name not in values["token_budget"]:
            return classify(target, None, None, self.min_samples, "no stallfree series in Prometheus")

        def get(key: str, default: float = 0.0) -> float:
            return values[key].get(name, default)

        def pct(field: str) -> Percentiles:
            count = int(round(get(f"{field}.count")))
            found = {q: values[f"{field}.{q}"].get(name) for q in QUANTILES}
            return Percentiles(count=count, p50=found["p50"], p90=found["p90"], p99=found["p99"], max=None)

        started_total = get("started_total")
        request_rate = get("finished_per_s") + get("failed_per_s")
        _, prompt_tokens_per_s = arrived_demand(
            request_rate, get("refused_per_s"), get("waiting_change") + get("running_change"), self.window_s,
            get("started_prompt_tokens_per_s"), get("started_per_s"),
            get("started_prompt_tokens_total") / started_total if started_total > 0 else None)
        budget = int(get("token_budget"))
        tuning = Tuning(token_budget=budget, max_num_seqs=int(get("max_num_seqs")),
                        max_partial_prefills=int(get("max_partial_prefills", 1)),
                        long_prefill_threshold=int(get("long_prefill_threshold")))
        stats = WindowStats(
            window_s=self.window_s, ttft_ms=pct("ttft_ms"), tpot_ms=pct("tpot_ms"), itl_ms=pct("itl_ms"),
            queue_wait_ms=pct("queue_wait_ms"), request_rate=request_rate,
            prompt_tokens_per_s=prompt_tokens_per_s, generation_tokens_per_s=get("generation_tokens_per_s"),
            prefill_tokens_per_s=get("prefill_tokens_per_s"), decode_tokens_per_s=get("decode_tokens_per_s"),
            budget_utilisation=min(1.0, get("tokens_per_iteration") / budget) if budget else 0.0,
            kv_usage=get("kv_usage"), preemptions=int(round(get("preemptions"))),
            num_waiting=int(get("num_waiting")), num_running=int(get("num_running")), tuning=tuning,
            ceilings=self.ceilings, iterations=int(round(get("iterations"))),
            mean_iteration_ms=values["mean_iteration_ms"].get(name),
            slow_paths=_slow_paths(int(get("slow_paths"))))
        return classify(target, stats, None, self.min_samples)
