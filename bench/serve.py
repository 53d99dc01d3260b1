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
import math
import os
import sys
from dataclasses import asdict
from typing import Any

import httpx

from stallfree.loadgen.prompts import PromptBuilder, load_prompt_tokenizer
from stallfree.loadgen.run import run_benchmark, summarize_results
from stallfree.simulator.emit import emit
from stallfree.simulator.latency_summary import SLOs
from stallfree.simulator.workload import generate
from stallfree.simulator.workload_args import add_workload_args, workload_from_args


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
