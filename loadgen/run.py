"""A whole load run: every request sent at its arrival offset, bounded in time; the results summarized.

Requests still open at the run's deadline are cancelled and counted as not completed. The summary holds the
percentiles of TTFT, TPOT, ITL and end-to-end time, throughput and goodput under SLOs.
"""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, Callable

import httpx

from stallfree.loadgen.stream import RequestResult, send_request, streaming_body
from stallfree.simulator.latency_summary import SLOs, summarize
from stallfree.simulator.workload import RequestSpec


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.failed, self.enabled = total, 0, 0, enabled
        self.start = time.monotonic()

    def step(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if self.enabled:
            width = 30
            filled = int(width * self.done / max(1, self.total))
            elapsed = time.monotonic() - self.start
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                             f"({self.failed} failed) {elapsed:.1f}s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def run_benchmark(base_url: str, requests: list[RequestSpec], prompts: list[str], model: str,
                        endpoint: str = "completions", api_key: str | None = None, max_concurrency: int | None = None,
                        timeout_s: float = 600.0, request_timeout_s: float = 300.0,
                        progress: bool = False, headers: dict[str, str] | None = None,
                        on_result: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival offset; returns the results and the wall time used. `headers` go with
    every request (an objective, a tenant); `on_result` sees each result as its request ends."""
    url = base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    headers = dict(headers or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    limits = httpx.Limits(max_connections=max_concurrency or 1000, max_keepalive_connections=max_concurrency or 1000)
    results = [RequestResult(i, r.prompt_len, r.output_len, r.arrival_s) for i, r in enumerate(requests)]
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = Progress(len(requests), progress)
    start = time.perf_counter()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        delay = requests[i].arrival_s - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        body = streaming_body(endpoint, model, prompts[i], requests[i].output_len)
        if semaphore is None:
            results[i].sent_s = time.perf_counter() - start
            await send_request(client, url, body, results[i], endpoint)
        else:
            async with semaphore:
                results[i].sent_s = time.perf_counter() - start
                await send_request(client, url, body, results[i], endpoint)
        bar.step(results[i].ok)
        if on_result is not None:
            on_result(results[i])

    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(request_timeout_s, connect=10.0),
                                 limits=limits) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(len(requests))]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    bar.close()
    for result in results:
        if not result.ok and result.error is None:
            result.error = "not completed before the benchmark's time limit" if result.sent_s is not None \
                else "never sent: the benchmark's time limit came first"
    return results, time.perf_counter() - start


def summarize_results(results: list[RequestResult], wall_s: float, slos: SLOs) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    for r in done:
        r.slo_met = slos.met(r.ttft_ms, r.tpot_ms, r.e2e_ms)
    ends = [(r.sent_s or 0.0) + (r.e2e_ms or 0.0) / 1000 for r in done]
    duration = max(ends) if ends else wall_s
    duration = max(duration, 1e-9)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(r.slo_met for r in done)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown")[:120]
            errors[key] = errors.get(key, 0) + 1
    return {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "wall_s": wall_s,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens or r.prompt_len for r in done),
        "ttft_ms": summarize(r.ttft_ms for r in done),
        "tpot_ms": summarize(r.tpot_ms for r in done if r.tpot_ms is not None),
        "itl_ms": summarize(gap for r in done for gap in r.itl_ms),
        "e2e_ms": summarize(r.e2e_ms for r in done),
        "slos": slos.to_dict(),
        "slo_attainment": good / len(done) if done else 0.0,
        "goodput": good / duration,
        "errors": errors,
    }
