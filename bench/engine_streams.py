"""The streams `bench engine` sends and the gaps it reads off them, against any OpenAI-compatible server.

Streaming /v1/completions through loadgen's client, temperature 0. A Target says where and whether the server
takes `ignore_eos`; without it the streams carry a long-generation prompt and report the tokens actually produced.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from stallfree.contracts import percentile
from stallfree.loadgen.stream import RequestResult, send_request, streaming_body

LANDING_STREAM_TOKENS = 1024  # outlasts the long prompt's prefill; cancelled once it has answered

# Without ignore_eos a stream may stop early; this tail asks for a long continuation (tokens produced are reported).
LONG_GENERATION_TAIL = "\n\nWrite a very long story, at least two thousand words, that uses every word above:\n"


@dataclass(frozen=True)
class Target:
    url: str
    model: str
    ignore_eos: bool = True

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body = streaming_body("completions", self.model, prompt, max_tokens)
        if not self.ignore_eos:
            body.pop("ignore_eos")
            if max_tokens > 1:
                body["prompt"] = prompt + LONG_GENERATION_TAIL
        return body


@dataclass
class Stream:
    result: RequestResult
    started: float = 0.0

    def token_times(self) -> list[float]:
        """perf_counter time of every content chunk (the first at TTFT, then each ITL after it)."""
        if self.result.ttft_ms is None:
            return []
        times = [self.started + self.result.ttft_ms / 1000.0]
        for gap in self.result.itl_ms:
            times.append(times[-1] + gap / 1000.0)
        return times

    def decode_tok_s(self) -> float:
        """Tokens after the first over the time after the first (the server's count when it sends usage)."""
        r = self.result
        return (r.output_tokens - 1) / max((r.e2e_ms - r.ttft_ms) / 1000.0, 1e-9)


async def send_stream(client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int,
                      stream: Stream) -> None:
    stream.started = time.perf_counter()
    await send_request(client, target.url + "/v1/completions", target.body(prompt, max_tokens), stream.result,
                       "completions")


def client(timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


async def run_streams(target: Target, prompts: list[str], max_tokens: int, timeout_s: float) -> tuple[
        list[Stream], float]:
    streams = [Stream(RequestResult(i, 0, max_tokens, 0.0)) for i in range(len(prompts))]
    async with client(timeout_s) as c:
        started = time.perf_counter()
        await asyncio.gather(*(send_stream(c, target, p, max_tokens, s) for p, s in zip(prompts, streams)))
        wall = time.perf_counter() - started
    for s in streams:
        if not s.result.ok:
            raise RuntimeError(f"a request failed: {s.result.error}")
    return streams, wall


async def run_landing(target: Target, stream_prompts: list[str], long_prompt: str, timeout_s: float) -> dict:
    """Streams decode; once each has a few tokens the long prompt lands; the gaps while it is prefilled."""
    streams = [Stream(RequestResult(i, 0, LANDING_STREAM_TOKENS, 0.0)) for i in range(len(stream_prompts))]
    long = Stream(RequestResult(-1, 0, 1, 0.0))
    async with client(timeout_s) as c:
        tasks = [asyncio.create_task(send_stream(c, target, p, LANDING_STREAM_TOKENS, s))
                 for p, s in zip(stream_prompts, streams)]
        deadline = time.perf_counter() + timeout_s
        while any(len(s.result.itl_ms) < 3 for s in streams) and time.perf_counter() < deadline:
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        await send_stream(c, target, long_prompt, 1, long)
        landed, answered = long.started, long.started + (long.result.ttft_ms or 0.0) / 1000.0
        await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not long.result.ok:
        raise RuntimeError(f"the long prompt failed: {long.result.error}")
    gaps = []
    for s in streams:
        times = s.token_times()
        gaps += [(b - a) * 1000.0 for a, b in zip(times, times[1:]) if b > landed and a < answered]
    gaps.sort()
    return {"ttft_ms": long.result.ttft_ms, "prompt_tokens": long.result.prompt_tokens, "gaps_during": len(gaps),
            "max_gap_ms": gaps[-1] if gaps else None, "p99_gap_ms": rank(gaps, 0.99),
            "p50_gap_ms": rank(gaps, 0.50)}


def rank(ordered: list[float], q: float) -> float | None:
    return percentile(ordered, q) if ordered else None


def all_gaps(streams: list[Stream]) -> list[float]:
    return sorted(g for s in streams for g in s.result.itl_ms)


def steady_gaps(streams: list[Stream]) -> list[float]:
    """Gaps once every stream is decoding (after the last first token) and before the first stream ends:
    steady load, without the admission of the other streams' prompts (a stall with a cause) in it."""
    times = [s.token_times() for s in streams]
    times = [t for t in times if t]
    if not times:
        return []
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    return sorted((b - a) * 1000.0 for t in times for a, b in zip(t, t[1:]) if a >= start and b <= end)


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
