"""`stallfree bench engine --url URL --model NAME`: the engine table's rows against any OpenAI-compatible server.

So stallfree and a peer (llama.cpp's server, vLLM) are compared by one client on one machine. Temperature 0;
`ignore_eos` when the server takes it (probed: a server that answers 4xx to it gets a long-generation prompt
instead, and every row counts the tokens actually produced). Rows:

- one stream, 128 tokens: decode tok/s after the first token;
- 16 streams x 128 tokens: total output tok/s;
- a 1,500-token prompt alone: TTFT (and prompt tokens / TTFT);
- the max decode gap of 4 streams while a 1,500-token prompt lands (the server's default settings);
- a serving load (bench/engine_serving.py): Poisson arrivals, 2 req/s of 512-token prompts and 64 output tokens,
  60 requests (vLLM's serving benchmark's shape): request throughput, output tok/s, TTFT and TPOT median and p99,
  p99 inter-token gap; `--serving-only` measures this row alone;
- with `--launch CMD...` (last on the line; the bench starts it, waits for its first answer, stops it at the
  end): process start to first answer (medians of --startup-repeats starts) and the peak RSS of the process
  tree (sampled over the whole run and read after the 16 streams).
"""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import httpx

from stallfree.bench.engine_serving import run_serving_load
from stallfree.bench.engine_streams import Target, all_gaps, median, rank, run_landing, run_streams
from stallfree.bench.launch import Launched, answers, launch
from stallfree.loadgen.prompts import PromptBuilder
from stallfree.bench.weight_bytes import bandwidth_row, describe, gguf_bytes_per_token, gguf_of, read_bandwidth_gb_s

URL_LABELS = {
    "single_stream_decode_tok_s": "one stream, {decode_tokens} tokens",
    "concurrent_total_tok_s": "{streams} streams x {decode_tokens}, total",
    "long_prompt_ttft_ms": "{long_prompt}-token prompt alone, TTFT",
    "landing_max_gap_ms": "max decode gap, {landing_streams} streams, {long_prompt}-token prompt lands, "
                          "default settings",
    "serving_load": "Poisson {serving_rate:g} req/s, {serving_prompt}-token prompts, {serving_output} output tokens, "
                    "{serving_requests} requests: request throughput",
    "startup_s": "process start to first answer (--launch)",
    "peak_rss_mb": "peak RSS of the process tree, whole run (--launch)",
}
# Which way is better, for the ratios of `--compare`.
HIGHER_IS_BETTER = {"single_stream_decode_tok_s", "concurrent_total_tok_s", "serving_load"}
# The serving-load row's figures beside its value, as printed and as `--compare` merges them.
SERVING_FIGURES = ("output_tok_s", "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms", "itl_p99_ms")
NOT_MEASURED = {"value": None, "note": "not measured (--serving-only)"}


def prompt_builder(tokenizer: str | None, model: str) -> tuple[PromptBuilder, str]:
    """Prompts of exact token counts: --tokenizer, else the model name when it names one (a shape, folder or
    .gguf), else SmolLM2's (embedded; the peers in docs/benchmarks.md serve it under names of their own)."""
    from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    for source in ([tokenizer] if tokenizer else [model, "smollm2-135m"]):
        path = embedded_gguf_path() if source == "smollm2-135m" else source
        try:
            return PromptBuilder(load_tokenizer(path)), source
        except (ValueError, OSError):
            if tokenizer:
                raise
    raise AssertionError("unreachable: the embedded tokenizer loads")


def probe_ignore_eos(client: httpx.Client, url: str, model: str, mode: str) -> bool:
    """on/off as told; auto: on unless a one-token request carrying it is refused (4xx) while one without it is not."""
    if mode != "auto":
        return mode == "on"
    base = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
    status = client.post(url + "/v1/completions", json={**base, "ignore_eos": True}).status_code
    if 400 <= status < 500:
        return client.post(url + "/v1/completions", json=base).status_code >= 400
    return True


def _texts(builder: PromptBuilder, count: int, tokens: int, seed: int) -> list[str]:
    return [builder.text(tokens, seed + i, lead=f"{seed + i}:") for i in range(count)]


def measure_rows(target: Target, builder: PromptBuilder, sizes: Any, timeout: float,
                 launched: Launched | None, say=print, serving_only: bool = False) -> dict[str, Any]:
    """Every row but start-up, one after the other against the running server."""
    if serving_only:
        rows = {key: dict(NOT_MEASURED) for key in ("single_stream_decode_tok_s", "concurrent_total_tok_s",
                                                    "long_prompt_ttft_ms", "landing_max_gap_ms")}
        rows["serving_load"] = measure_serving(target, builder, sizes, timeout, say)
    else:
        rows = measure_one_at_a_time(target, builder, sizes, timeout, launched, say)
        rows["serving_load"] = measure_serving(target, builder, sizes, timeout, say)
    if launched:
        whole = launched.memory_mb()
        rows["peak_rss_mb"] = {"value": whole["peak_rss_mb"], "unit": "MB", **{f"whole_{k}": v for k, v in
                               whole.items()}, "after_streams": rows.pop("_after_streams", None)}
    else:
        rows["peak_rss_mb"] = {"value": None, "unit": "MB", "note": "needs --launch"}
    return rows


def measure_serving(target: Target, builder: PromptBuilder, sizes: Any, timeout: float, say=print) -> dict[str, Any]:
    """The serving-load row: Poisson arrivals of distinct prompts (a cold prefix cache), every request streamed."""
    prompts = _texts(builder, sizes.serving_requests, sizes.serving_prompt, 90_000)
    say(f"  serving load: {sizes.serving_requests} requests at {sizes.serving_rate:g}/s, {sizes.serving_prompt}-token "
        f"prompts, {sizes.serving_output} output tokens")
    row = asyncio.run(run_serving_load(target, prompts, sizes.serving_output, sizes.serving_rate, 7, timeout))
    say(f"  serving load: {fmt(row)}")
    return row


def measure_one_at_a_time(target: Target, builder: PromptBuilder, sizes: Any, timeout: float,
                          launched: Launched | None, say=print) -> dict[str, Any]:
    """The rows that send one kind of request at a time: one stream, 16 streams, a long prompt, its landing."""
    rows: dict[str, Any] = {}
    seed = 20_000
    single, produced = [], []
    for r in range(sizes.repeats):
        (s,), _ = asyncio.run(run_streams(target, _texts(builder, 1, sizes.short_prompt, seed), sizes.decode_tokens,
                                          timeout))
        seed += 1
        single.append(s.decode_tok_s())
        produced.append(s.result.output_tokens)
        say(f"  one stream {r + 1}/{sizes.repeats}: {single[-1]:.1f} tok/s ({produced[-1]} tokens)")
    rows["single_stream_decode_tok_s"] = {"value": median(single), "unit": "tok/s", "runs": single,
                                          "tokens_asked": sizes.decode_tokens, "tokens_produced": produced}
    totals, produced, p99s, maxes = [], [], [], []
    for r in range(sizes.repeats):
        streams, wall = asyncio.run(run_streams(target, _texts(builder, sizes.streams, sizes.short_prompt, seed),
                                                sizes.decode_tokens, timeout))
        seed += sizes.streams
        produced.append(sum(s.result.output_tokens for s in streams))
        totals.append(produced[-1] / wall)
        gaps = all_gaps(streams)
        p99s.append(rank(gaps, 0.99))
        maxes.append(gaps[-1] if gaps else None)
        say(f"  {sizes.streams} streams {r + 1}/{sizes.repeats}: {totals[-1]:.1f} tok/s total ({produced[-1]} "
            f"tokens), gap p99 {p99s[-1] or 0:.0f} ms, max {maxes[-1] or 0:.0f} ms")
    rows["concurrent_total_tok_s"] = {"value": median(totals), "unit": "tok/s", "runs": totals,
                                      "streams": sizes.streams, "tokens_asked": sizes.streams * sizes.decode_tokens,
                                      "tokens_produced": produced, "p99_gap_ms": median(p99s),
                                      "max_gap_ms": median(maxes)}
    rows["_after_streams"] = launched.memory_mb() if launched else None
    alone, prompt_tokens = [], []
    for r in range(sizes.repeats):
        (s,), _ = asyncio.run(run_streams(target, _texts(builder, 1, sizes.long_prompt, seed), 1, timeout))
        seed += 1
        alone.append(s.result.ttft_ms)
        prompt_tokens.append(s.result.prompt_tokens)
        say(f"  {sizes.long_prompt}-token prompt alone {r + 1}/{sizes.repeats}: TTFT {alone[-1]:.0f} ms "
            f"(server counted {prompt_tokens[-1]} prompt tokens)")
    ttft = median(alone)
    rows["long_prompt_ttft_ms"] = {"value": ttft, "unit": "ms", "runs": alone, "prompt_tokens": prompt_tokens,
                                   "prefill_tok_s": sizes.long_prompt / (ttft / 1000.0) if ttft else None}
    runs = []
    for r in range(sizes.repeats):
        streams = _texts(builder, sizes.landing_streams, sizes.short_prompt, seed)
        long = builder.text(sizes.long_prompt, seed + 999, lead=f"{seed + 999}:")
        seed += sizes.landing_streams + 1
        runs.append(asyncio.run(run_landing(target, streams, long, timeout)))
        say(f"  landing {r + 1}/{sizes.repeats}: max gap {runs[-1]['max_gap_ms'] or 0:.0f} ms, p99 "
            f"{runs[-1]['p99_gap_ms'] or 0:.0f} ms over {runs[-1]['gaps_during']} gaps, TTFT "
            f"{runs[-1]['ttft_ms']:.0f} ms")
    rows["landing_max_gap_ms"] = {"value": median([r["max_gap_ms"] for r in runs]), "unit": "ms",
                                  "p99_gap_ms": median([r["p99_gap_ms"] for r in runs]),
                                  "ttft_ms": median([r["ttft_ms"] for r in runs]), "runs": runs,
                                  "streams": sizes.landing_streams}
    return rows


def measure(args: argparse.Namespace, sizes: Any, work: Path, say=print) -> dict[str, Any]:
    url, cmd = args.url.rstrip("/"), args.launch
    builder, source = prompt_builder(args.tokenizer, args.model)
    say(f"  prompts built with the {source} tokenizer")
    machine_gb_s = read_bandwidth_gb_s()  # before the server starts: the machine alone
    say(f"  the machine's read bandwidth: {machine_gb_s:.1f} GB/s")
    launched, starts = None, []
    if cmd:
        with httpx.Client(timeout=5.0) as client:
            if answers(client, url, args.model):
                raise RuntimeError(f"something already answers at {url}: stop it, or drop --launch")
        say(f"  launching: {' '.join(cmd)}")
        launched = launch(cmd, url, args.model, work / "launch-0.log", args.start_timeout_s)
        starts.append(launched.first_answer_s)
        say(f"  it answered {launched.first_answer_s:.2f} s after its process started")
    try:
        with httpx.Client(timeout=args.request_timeout_s) as client:
            target = Target(url, args.model, probe_ignore_eos(client, url, args.model, args.ignore_eos))
        say(f"  ignore_eos: {'sent' if target.ignore_eos else 'not taken: long-generation prompts, tokens counted'}")
        rows = measure_rows(target, builder, sizes, args.request_timeout_s, launched, say,
                            serving_only=getattr(args, "serving_only", False))
    finally:
        if launched:
            launched.stop()
    for i in range(1, sizes.startup_repeats if cmd else 0):
        again = launch(cmd, url, args.model, work / f"launch-{i}.log", args.start_timeout_s)
        again.stop()
        starts.append(again.first_answer_s)
        say(f"  start {i + 1}/{sizes.startup_repeats}: answered after {starts[-1]:.2f} s")
    rows["startup_s"] = ({"value": median(starts), "unit": "s", "runs": starts} if cmd else
                         {"value": None, "unit": "s", "note": "needs --launch"})
    rows["ignore_eos"] = target.ignore_eos
    path = gguf_of(args.gguf or args.tokenizer or args.model)
    rows["single_stream_bandwidth"] = bandwidth_row(rows.get("single_stream_decode_tok_s", {}).get("value"),
                                                    gguf_bytes_per_token(path) if path else None, machine_gb_s)
    return rows


def fmt(row: dict[str, Any]) -> str:
    value = row.get("value")
    if value is None:
        return "- (" + row.get("note", "no figure") + ")"
    text = f"{value:,.0f} {row['unit']}" if value >= 100 else f"{value:.2f} {row['unit']}"
    extras = []
    if row.get("prefill_tok_s"):
        extras.append(f"{row['prefill_tok_s']:.0f} prompt tok/s")
    for key in ("p99_gap_ms", "ttft_ms"):
        if row.get(key) is not None:
            extras.append(f"{key.replace('_ms', '').replace('_', ' ')} {row[key]:.0f} ms")
    if row.get("ttft_median_ms") is not None:
        extras.append(f"TTFT median {row['ttft_median_ms']:,.0f} / p99 {row['ttft_p99_ms']:,.0f} ms, TPOT median "
                      f"{row['tpot_median_ms']:,.0f} / p99 {row['tpot_p99_ms']:,.0f} ms, p99 ITL "
                      f"{row['itl_p99_ms']:,.0f} ms, {row['output_tok_s']:.1f} output tok/s")
    if row.get("failed"):
        extras.append(f"{row['failed']} of {row['requests']} failed")
    if row.get("whole_processes"):
        extras.append(f"{row['whole_processes']} processes")
    return text + (f" ({', '.join(extras)})" if extras else "")


def report(rows: dict[str, Any], sizes: Any, label: str) -> str:
    lines = [f"| figure | {label} |", "|---|---|"]
    for key, text in URL_LABELS.items():
        lines.append(f"| {text.format(**sizes.__dict__)} | {fmt(rows.get(key, NOT_MEASURED))} |")
    if rows.get("single_stream_bandwidth"):
        lines.append(f"\none stream reads {describe(rows['single_stream_bandwidth'])}")
    if not rows.get("ignore_eos", True):
        lines.append("\nignore_eos was not taken: figures count the tokens the server actually produced.")
    return "\n".join(lines)
