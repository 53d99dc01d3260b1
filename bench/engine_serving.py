"""`bench engine --url`'s serving-load row: Poisson arrivals against any OpenAI-compatible server.

vLLM's serving benchmark's shape (`vllm bench serve --dataset-name random --random-input-len 512
--random-output-len 64 --num-prompts 60 --request-rate 2 --ignore-eos`): requests of exact prompt length arrive
at exponential gaps (seeded), each streams its output, and the figures are read as that benchmark reads them:
request and output-token throughput over the run (first send to last completion), TTFT median and p99, TPOT
(time after the first token over the tokens after it, per request) median and p99, and p99 of every
inter-token gap. Under an arrival rate past what the server sustains, TTFT is mostly queueing: the row shows
how a server holds up under load, which the one-at-a-time rows do not.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from stallfree.arrivals import arrival_times
from stallfree.bench.engine_streams import Stream, Target, client, rank, send_stream
from stallfree.loadgen.stream import RequestResult


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of `count` Poisson arrivals at `rate` per second; the first at 0."""
    return list(arrival_times(rate, random.Random(seed), count=count, first_at_start=True))


async def run_serving_load(target: Target, prompts: list[str], output_tokens: int, rate: float, seed: int,
                           timeout_s: float) -> dict[str, Any]:
    streams = [Stream(RequestResult(i, 0, output_tokens, 0.0)) for i in range(len(prompts))]
    offsets = arrival_offsets(len(prompts), rate, seed)
    async with client(timeout_s) as c:
        started = time.perf_counter()

        async def one(prompt: str, stream: Stream, offset: float) -> None:
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            await send_stream(c, target, prompt, output_tokens, stream)

        await asyncio.gather(*(one(p, s, o) for p, s, o in zip(prompts, streams, offsets)))
        wall = time.perf_counter() - started
    return summarize([s.result for s in streams], wall, rate)


def summarize(results: list[RequestResult], wall_s: float, rate: float) -> dict[str, Any]:
    """The serving benchmark's figures over the completed requests (failed ones counted apart)."""
    done = [r for r in results if r.ok]
    ttft = sorted(r.ttft_ms for r in done if r.ttft_ms is not None)
    tpot = sorted(r.tpot_ms for r in done if r.tpot_ms is not None)
    itl = sorted(g for r in done for g in r.itl_ms)
    return {"value": len(done) / wall_s if wall_s > 0 else None, "unit": "req/s", "requests": len(results),
            "failed": len(results) - len(done), "rate": rate, "duration_s": wall_s,
            "output_tok_s": sum(r.output_tokens for r in done) / wall_s if wall_s > 0 else None,
            "ttft_median_ms": rank(ttft, 0.5), "ttft_p99_ms": rank(ttft, 0.99),
            "tpot_median_ms": rank(tpot, 0.5), "tpot_p99_ms": rank(tpot, 0.99), "itl_p99_ms": rank(itl, 0.99)}
