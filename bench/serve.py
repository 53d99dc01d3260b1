"""`stallfree bench serve`: load against any OpenAI-compatible endpoint, measured from the client.

The same workload specification as `stallfree simulate` (arrivals, length distributions, shared
prefixes), sent as streaming /v1/completions or /v1/chat/completions requests with `max_tokens` and
`ignore_eos` so outputs have the asked length. Per request: TTFT (send to first content chunk), ITL
(gaps between content chunks), TPOT ((end - first token) / (output tokens - 1)) and end-to-end time;
in summary their percentiles, throughput and goodput under SLOs. Bounded by --num-requests and
--timeout-s: requests still open at the deadline are cancelled and counted as not completed.

Prompt text is built from plain words to the asked token count: exactly with --tokenizer (a model
folder, .gguf or shape name), else by --chars-per-token (about 4 for English BPE, 1 for the sim
daemon's byte-level tokenizer). The server's usage figures, when it sends them, are what is reported.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import httpx

from stallfree.simulator.latency_summary import SLOs, summarize
from stallfree.cli.simulate import emit
from stallfree.simulator.workload import RequestSpec, generate
from stallfree.simulator.workload_args import add_workload_args, workload_from_args

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "number group problem fact river mountain garden window engine cloud signal market music letter paper "
          "story light water table road voice field state city night heart power money table answer reason").split()


@dataclass
class RequestResult:
    index: int
    prompt_len: int  # what the workload asked for
    output_len: int
    scheduled_s: float  # arrival offset from the benchmark start
    sent_s: float | None = None
    ok: bool = False
    error: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # the server's usage, when given
    output_tokens: int = 0
    slo_met: bool = False


# ---- prompts ----------------------------------------------------------------------------------


class PromptBuilder:
    """Text of a given token length: exact with a tokenizer, approximate by characters per token."""

    def __init__(self, tokenizer: Any | None = None, chars_per_token: float = 4.0) -> None:
        if tokenizer is None and not chars_per_token > 0:
            raise ValueError(f"chars_per_token must be positive, got {chars_per_token}")
        self.tokenizer = tokenizer
        self.chars_per_token = chars_per_token

    def text(self, num_tokens: int, seed: int, lead: str = "") -> str:
        rng = random.Random(seed)
        if self.tokenizer is None:
            chars = max(1, round(num_tokens * self.chars_per_token))
            parts, length = [lead] if lead else [], len(lead)
            while length < chars:
                word = (" " if parts else "") + rng.choice(_WORDS)
                parts.append(word)
                length += len(word)
            return "".join(parts)[:chars]
        words = [lead] if lead else []
        ids: list[int] = []
        while len(ids) < num_tokens:
            words += [rng.choice(_WORDS) for _ in range(max(8, num_tokens - len(ids)))]
            ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False)
        return self.tokenizer.decode(ids[:num_tokens])

    def prompt(self, request: RequestSpec, index: int) -> str:
        """The group's shared prefix, then text that opens with the request's index (no accidental cache hits)."""
        shared = self.text(request.shared_prefix_len, 1_000_003 + request.prefix_group) if request.shared_prefix_len else ""
        unique = self.text(request.prompt_len - request.shared_prefix_len, index, lead=f"{index}:")
        return shared + (" " if shared and unique else "") + unique


def load_prompt_tokenizer(source: str) -> Any:
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    return load_tokenizer(source)


# ---- one request ------------------------------------------------------------------------------


def streaming_body(endpoint: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


class StreamError(Exception):
    """An OpenAI-style stream that answered with an HTTP error or carried an error event."""


async def stream_events(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                        timeout: float | None | httpx.Timeout = httpx.USE_CLIENT_DEFAULT):
    """POST a streaming request and yield each JSON event up to [DONE]; StreamError for an HTTP or in-stream
    error (the message carries its first 300 characters)."""
    async with client.stream("POST", url, json=body, timeout=timeout) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise StreamError(f"HTTP {response.status_code}: {text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise StreamError(f"stream error: {json.dumps(event['error'])[:300]}")
            yield event


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult,
                       endpoint: str, clock: Callable[[], float] = time.perf_counter) -> None:
    """Stream one request and fill `result` (errors are recorded, never raised)."""
    start = clock()
    last = None
    chunks = 0
    try:
        async for event in stream_events(client, url, body):
            usage = event.get("usage")
            if usage:
                result.prompt_tokens = usage.get("prompt_tokens")
                result.output_tokens = usage.get("completion_tokens") or result.output_tokens
            for choice in event.get("choices") or []:
                text = choice.get("text") if endpoint == "completions" else (choice.get("delta") or {}).get("content")
                if not text:
                    continue
                now = clock()
                if last is None:
                    result.ttft_ms = (now - start) * 1000
                else:
                    result.itl_ms.append((now - last) * 1000)
                last = now
                chunks += 1
    except StreamError as exc:
        result.error = str(exc)
        return
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return
    end = clock()
    result.e2e_ms = (end - start) * 1000
    result.output_tokens = result.output_tokens or chunks
    if result.ttft_ms is None:
        result.error = "the stream ended without any output"
        return
    if result.output_tokens > 1:
        result.tpot_ms = (result.e2e_ms - result.ttft_ms) / (result.output_tokens - 1)
    result.ok = True


# ---- the run ----------------------------------------------------------------------------------


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
                        progress: bool = False) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival offset; returns the results and the wall time used."""
    url = base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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


# ---- the command ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallfree bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_argument_group("endpoint")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    target.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    target.add_argument("--api-key", help="bearer token (default: env OPENAI_API_KEY or STALLFREE_API_KEY)")
    add_workload_args(parser, num_requests=100, rate=2.0)
    prompts = parser.add_argument_group("prompt text")
    prompts.add_argument("--tokenizer", help="count prompt tokens exactly with this model folder, .gguf or shape")
    prompts.add_argument("--chars-per-token", type=float, default=4.0,
                         help="without --tokenizer: characters per token (4 for English BPE, 1 for the sim daemon)")
    bounds = parser.add_argument_group("bounds")
    bounds.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    bounds.add_argument("--timeout-s", type=float, default=600.0, help="the whole benchmark's wall-clock limit")
    bounds.add_argument("--request-timeout-s", type=float, default=300.0)
    slo = parser.add_argument_group("SLOs (goodput)")
    slo.add_argument("--ttft-slo-ms", type=float)
    slo.add_argument("--tpot-slo-ms", type=float)
    slo.add_argument("--e2e-slo-ms", type=float)
    out = parser.add_argument_group("output")
    out.add_argument("--json", nargs="?", const="-", metavar="FILE", help="JSON to FILE, or to stdout without one")
    out.add_argument("--per-request", action="store_true", help="include every request in the JSON")
    out.add_argument("--plot", metavar="FILE.png", help="CDFs of TTFT, TPOT, ITL and end-to-end latency")
    out.add_argument("--no-progress", action="store_true")
    return parser


def discover_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"cannot list models at {base_url}/v1/models ({exc}); pass --model") from None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(summary: dict[str, Any], base_url: str, model: str) -> str:
    lines = [f"{summary['completed']}/{summary['num_requests']} requests completed against {base_url} ({model}) "
             f"in {summary['duration_s']:.1f} s; {summary['failed']} failed"]
    lines.append(f"throughput: {summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s")
    lines.append(f"{'metric':<12}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}   (ms)")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end")):
        s = summary[key]
        lines.append(f"{name:<12}{_fmt(s['mean']):>9}{_fmt(s['p50']):>9}{_fmt(s['p90']):>9}{_fmt(s['p99']):>9}"
                     f"{_fmt(s['max']):>9}")
    slos = {k: v for k, v in summary["slos"].items() if v is not None}
    if slos:
        lines.append(f"goodput under {slos}: {summary['goodput']:.2f} req/s ({summary['slo_attainment']:.1%} of requests)")
    for error, count in summary["errors"].items():
        lines.append(f"  {count} x {error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.timeout_s <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
            raise ValueError("--timeout-s must be positive and --max-concurrency at least 1")
        workload = workload_from_args(args)
        requests = generate(workload)
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("STALLFREE_API_KEY")
        model = args.model or discover_model(args.base_url, api_key)
        builder = PromptBuilder(load_prompt_tokenizer(args.tokenizer) if args.tokenizer else None, args.chars_per_token)
    except ValueError as exc:
        print(f"stallfree bench serve: error: {exc}", file=sys.stderr)
        return 2
    prompts = [builder.prompt(r, i) for i, r in enumerate(requests)]
    slos = SLOs(args.ttft_slo_ms, args.tpot_slo_ms, args.e2e_slo_ms)
    results, wall_s = asyncio.run(run_benchmark(
        args.base_url, requests, prompts, model, args.endpoint, api_key, args.max_concurrency, args.timeout_s,
        args.request_timeout_s, progress=not args.no_progress and sys.stderr.isatty()))
    summary = summarize_results(results, wall_s, slos)
    payload: dict[str, Any] = {
        "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
        "workload": {"arrival": workload.arrival, "rate": workload.rate if not math.isinf(workload.rate) else "inf",
                     "burstiness": workload.burstiness, "prompt": workload.prompt.describe(),
                     "output": workload.output.describe(), "num_requests": len(requests), "seed": workload.seed,
                     "shared_prefix_fraction": workload.shared_prefix_fraction},
        "summary": summary,
    }
    if args.per_request:
        payload["requests"] = [asdict(r) for r in results]
    text = report(summary, args.base_url, model)
    if args.plot:
        from stallfree.simulator.plots import latency_cdfs

        done = [r for r in results if r.ok]
        latency_cdfs({model: {"ttft_ms": [r.ttft_ms for r in done], "tpot_ms": [r.tpot_ms for r in done],
                              "itl_ms": [g for r in done for g in r.itl_ms], "e2e_ms": [r.e2e_ms for r in done]}},
                     args.plot, f"bench serve: {args.base_url} ({model})",
                     {"ttft_ms": slos.ttft_ms, "tpot_ms": slos.tpot_ms, "e2e_ms": slos.e2e_ms})
    emit(args, payload, text)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
