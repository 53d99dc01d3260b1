"""`stallfree bench engine`: every row of the engine-speed table, measured against a real `stallfree serve`.

One daemon process at a time, started here and stopped after its rows, with a profile cache directory of
its own (empty at first: the first start is the cold one). Streaming /v1/completions requests through
loadgen's client, temperature 0, `ignore_eos` so outputs have the asked length; medians of
--repeats where the table says so. Rows:

- single-stream decode of 128 tokens (tok/s after the first token), default flags;
- 16 concurrent streams x 128 tokens (total output tok/s), with the streams' p99 and max gap, over the whole
  run and in steady state (every stream decoding: the other prompts' admission excluded);
- a 1,500-token prompt alone (prefill tok/s = prompt tokens / TTFT);
- 4 streams decoding when a 1,500-token prompt lands, `--token-budget 256`: max and p99 gap while it is
  prefilled, and its TTFT;
- the same with `--tpot-slo-ms 150` and no budget flag (the budget the daemon chose from its profile);
- start-up cold (empty profile cache) and cached: process start to first answer;
- peak RSS (VmHWM) of the daemon after the 16 streams, beside the KV cache size it ran with.

Every result records the CPU (its tier, flags and model, bench/cpu_record.py) and the paths each daemon's start-up
named. A model past 1B: `stallfree bench write-gguf --type q4_0` (or q4_k_m) writes a random-weight GGUF of
Llama-3.2-1B's shape, then `--model runs/llama-3.2-1b-shape-q4_0.gguf`.

`--quick` shrinks every size (a smoke test, e.g. on the sim backend); its figures are not the table's.

`--url URL --model NAME [--launch CMD...]` measures any OpenAI-compatible server instead (bench/engine_url.py),
and `--compare A.json B.json ...` prints such runs side by side (bench/engine_compare.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from stallfree.bench.cpu_record import cpu_record, paths_from_logs
from stallfree.bench.engine_streams import (Target, all_gaps, median, rank, run_landing, run_streams,
                                            steady_gaps)
from stallfree.loadgen.prompts import PromptBuilder
from stallfree.bench.weight_bytes import bandwidth_row, describe, gguf_bytes_per_token, gguf_of, read_bandwidth_gb_s


@dataclass
class Sizes:
    decode_tokens: int = 128
    streams: int = 16
    long_prompt: int = 1500
    landing_streams: int = 4
    landing_budget: int = 256
    tpot_slo_ms: float = 150.0
    repeats: int = 3
    startup_repeats: int = 3
    short_prompt: int = 16
    # --url's serving-load row (bench/engine_serving.py): vLLM's serving benchmark's shape.
    serving_rate: float = 2.0
    serving_prompt: int = 512
    serving_output: int = 64
    serving_requests: int = 60


QUICK = Sizes(decode_tokens=16, streams=4, long_prompt=300, landing_streams=2, repeats=1, startup_repeats=1,
              serving_rate=4.0, serving_prompt=64, serving_output=8, serving_requests=6)

GOALS = {
    "single_stream_decode_tok_s": ">= 125 tok/s",
    "concurrent_total_tok_s": ">= 560 tok/s",
    "prefill_tok_s": ">= 700 tok/s",
    "landing_max_gap_ms": "<= 350 ms",
    "slo_landing": "p99 gap <= 150 ms, max <= 225 ms, TTFT <= 1.3x alone",
    "startup_cold_s": "<= 30 s",
    "startup_cached_s": "<= 10 s",
    "peak_rss_mb": "report it (the KV cache size is a flag)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree bench engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="what `stallfree serve --model` takes: smollm2-135m (embedded), a shape name, a Hugging Face "
                        "folder or a .gguf file (runs/llama-3.2-1b-shape-q4_0.gguf: `stallfree bench write-gguf`)")
    p.add_argument("--backend", choices=["model", "sim"], default="model")
    p.add_argument("--hardware", default="h100", help="sim backend: hardware preset")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke test, not the table")
    p.add_argument("--repeats", type=int, default=None, help="repetitions per row (median kept; default 3)")
    p.add_argument("--startup-repeats", type=int, default=None, help="cold and cached starts each (default 3)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra flag for every daemon (repeatable)")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--output", default="runs/bench_engine.json", help="where the JSON goes")
    p.add_argument("--keep-logs", default=None, help="copy each daemon's log into this folder")
    u = p.add_argument_group("any OpenAI-compatible server (instead of starting stallfree daemons)")
    u.add_argument("--url", default=None, help="measure the server at this base URL (e.g. http://127.0.0.1:18101)")
    u.add_argument("--label", default=None, help="its name in the printed table and the JSON (default: --model)")
    p.add_argument("--gguf", default=None, help="the GGUF file the server serves (default: --model or --tokenizer "
                   "where it names one): the one-stream row's bytes a token and GB/s")
    u.add_argument("--tokenizer", default=None,
                   help="builds prompts of exact token counts: a model folder, .gguf or shape name, smollm2-135m "
                        "(embedded; the default unless --model names a tokenizer)")
    u.add_argument("--ignore-eos", choices=["auto", "on", "off"], default="auto",
                   help="auto: sent unless the server refuses it")
    u.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                   help="print earlier --url runs side by side (ratios to the first) and exit")
    u.add_argument("--serving-only", action="store_true",
                   help="measure only the serving-load row (and, with --launch, start-up and RSS)")
    u.add_argument("--serving-rate", type=float, default=None, help="serving-load row: arrivals per second (2)")
    u.add_argument("--serving-requests", type=int, default=None, help="serving-load row: requests sent (60)")
    u.add_argument("--launch", nargs=argparse.REMAINDER, default=None, metavar="CMD",
                   help="last on the line: the server's command; the bench starts it (start-up, RSS rows), stops it")
    return p


# ---- daemons ----------------------------------------------------------------------------------


@dataclass
class Daemon:
    process: subprocess.Popen
    url: str
    log_path: Path
    label: str
    first_answer_s: float = float("nan")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def peak_rss_mb(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
        except (OSError, ValueError):
            pass
        return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_daemon(args: argparse.Namespace, label: str, cache_dir: Path, log_dir: Path, extra: list[str]) -> Daemon:
    """Start `stallfree serve`, wait for its first answer; first_answer_s is from Popen to that answer."""
    port = _free_port()
    cmd = [sys.executable, "-m", "stallfree.cli", "serve", "--model", args.model, "--backend", args.backend,
           "--hardware", args.hardware, "--host", "127.0.0.1", "--port", str(port), *extra, *args.serve_arg]
    env = dict(os.environ, STALLFREE_PROFILE_CACHE=str(cache_dir))
    log_path = log_dir / f"{label}.log"
    url = f"http://127.0.0.1:{port}"
    body = {"model": args.model, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
    print(f"  starting daemon '{label}': serve {' '.join(cmd[5:])}", flush=True)
    with open(log_path, "wb") as log:
        started = time.perf_counter()
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    daemon = Daemon(process, url, log_path, label)
    deadline = started + args.start_timeout_s
    with httpx.Client(timeout=30.0) as client:
        while time.perf_counter() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"daemon '{label}' exited with {process.returncode}:\n{daemon.log_text()[-3000:]}")
            try:
                if client.post(url + "/v1/completions", json=body).status_code == 200:
                    daemon.first_answer_s = time.perf_counter() - started
                    print(f"  daemon '{label}' answered {daemon.first_answer_s:.1f} s after its process started",
                          flush=True)
                    return daemon
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    stop_daemon(daemon)
    raise RuntimeError(f"daemon '{label}' did not answer within {args.start_timeout_s:g} s")


def stop_daemon(daemon: Daemon) -> None:
    if daemon.process.poll() is None:
        daemon.process.terminate()
        try:
            daemon.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.process.kill()
            daemon.process.wait()


# ---- rows -------------------------------------------------------------------------------------


def _prompts(builder: PromptBuilder, count: int, tokens: int, seed: int) -> list[str]:
    return [builder.text(tokens, seed + i, lead=f"{seed + i}:") for i in range(count)]


def prompt_builder(args: argparse.Namespace) -> PromptBuilder:
    if args.backend == "sim":
        return PromptBuilder(None, chars_per_token=1.0)  # the sim daemon's tokenizer is byte-level
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    source = args.model
    if source == "smollm2-135m":
        from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path

        source = embedded_gguf_path()
    try:
        return PromptBuilder(load_tokenizer(source))
    except ValueError:
        return PromptBuilder(None, chars_per_token=4.0)


def _log_int(text: str, pattern: str) -> list[int] | None:
    match = re.search(pattern, text)
    return [int(g) for g in match.groups()] if match else None


def measure(args: argparse.Namespace, sizes: Sizes, work: Path) -> dict[str, Any]:
    builder = prompt_builder(args)
    timeout = args.request_timeout_s
    cache_dir = work / "cache-main"
    rows: dict[str, Any] = {}
    seed = 10_000

    machine_gb_s = read_bandwidth_gb_s()  # before any daemon: the machine alone
    print(f"  the machine's read bandwidth: {machine_gb_s:.1f} GB/s", flush=True)
    # Default flags, empty cache: the cold start, then single stream, 16 streams (RSS), prefill alone.
    daemon = start_daemon(args, "default", cache_dir, work, [])
    cold = [daemon.first_answer_s]
    target = Target(daemon.url, args.model)
    try:
        single = []
        for r in range(sizes.repeats):
            (s,), _ = asyncio.run(run_streams(target, _prompts(builder, 1, sizes.short_prompt, seed),
                                              sizes.decode_tokens, timeout))
            seed += 1
            single.append(s.decode_tok_s())
            print(f"  single stream {r + 1}/{sizes.repeats}: {single[-1]:.1f} tok/s", flush=True)
        rows["single_stream_decode_tok_s"] = {"value": median(single), "unit": "tok/s", "runs": single,
                                              "tokens": sizes.decode_tokens}
        path = gguf_of(args.gguf or args.model)
        rows["single_stream_bandwidth"] = bandwidth_row(median(single), gguf_bytes_per_token(path) if path else None,
                                                        machine_gb_s)
        totals, p99s, maxes, steady_p99s, steady_maxes = [], [], [], [], []
        for r in range(sizes.repeats):
            streams, wall = asyncio.run(run_streams(target,
                                                    _prompts(builder, sizes.streams, sizes.short_prompt, seed),
                                                    sizes.decode_tokens, timeout))
            seed += sizes.streams
            gaps, steady = all_gaps(streams), steady_gaps(streams)
            totals.append(sum(s.result.output_tokens for s in streams) / wall)
            p99s.append(rank(gaps, 0.99))
            maxes.append(gaps[-1] if gaps else None)
            steady_p99s.append(rank(steady, 0.99))
            steady_maxes.append(steady[-1] if steady else None)
            print(f"  {sizes.streams} streams {r + 1}/{sizes.repeats}: {totals[-1]:.1f} tok/s total, gap p99 "
                  f"{p99s[-1]:.0f} ms, max {maxes[-1]:.0f} ms; steady (all decoding) p99 "
                  f"{steady_p99s[-1] or 0:.0f} ms, max {steady_maxes[-1] or 0:.0f} ms", flush=True)
        rows["concurrent_total_tok_s"] = {
            "value": median(totals), "unit": "tok/s", "runs": totals, "streams": sizes.streams,
            "tokens": sizes.decode_tokens, "p99_gap_ms": median(p99s), "max_gap_ms": median(maxes),
            "max_over_p99": [m / p for m, p in zip(maxes, p99s) if m and p],
            "steady_p99_gap_ms": median(steady_p99s), "steady_max_gap_ms": median(steady_maxes),
            "steady_max_over_p99": [m / p for m, p in zip(steady_maxes, steady_p99s) if m and p]}
        kv = _log_int(daemon.log_text(), r"(\d+) KV blocks of (\d+)")
        rows["peak_rss_mb"] = {"value": daemon.peak_rss_mb(), "unit": "MB", "after": f"{sizes.streams} streams",
                               "kv_blocks": kv[0] if kv else None, "block_size": kv[1] if kv else None,
                               "kv_flag": "--num-kv-blocks N (0: from --kv-memory-fraction)"}
        alone = []
        for r in range(sizes.repeats):
            (s,), _ = asyncio.run(run_streams(target, _prompts(builder, 1, sizes.long_prompt, seed),
                                              1, timeout))
            seed += 1
            alone.append(s.result.ttft_ms)
            print(f"  {sizes.long_prompt}-token prompt alone {r + 1}/{sizes.repeats}: TTFT {alone[-1]:.0f} ms",
                  flush=True)
        alone_ms = median(alone)
        rows["prefill_tok_s"] = {"value": sizes.long_prompt / (alone_ms / 1000.0), "unit": "tok/s",
                                 "ttft_ms": alone_ms, "runs_ttft_ms": alone, "prompt_tokens": sizes.long_prompt}
    finally:
        stop_daemon(daemon)

    def landing(label: str, extra: list[str]) -> tuple[Daemon, list[dict]]:
        nonlocal seed
        d = start_daemon(args, label, cache_dir, work, extra)
        try:
            runs = []
            for r in range(sizes.repeats):
                streams = _prompts(builder, sizes.landing_streams, sizes.short_prompt, seed)
                long = builder.text(sizes.long_prompt, seed + 999, lead=f"{seed + 999}:")
                seed += sizes.landing_streams + 1
                runs.append(asyncio.run(run_landing(Target(d.url, args.model), streams, long, timeout)))
                print(f"  {label} {r + 1}/{sizes.repeats}: max gap {runs[-1]['max_gap_ms'] or 0:.0f} ms, p99 "
                      f"{runs[-1]['p99_gap_ms'] or 0:.0f} ms, TTFT {runs[-1]['ttft_ms']:.0f} ms", flush=True)
        finally:
            stop_daemon(d)
        return d, runs

    d, runs = landing("budget-256", ["--token-budget", str(sizes.landing_budget)])
    cached = [d.first_answer_s]
    cache_hits = ["cached profile from" in d.log_text()]
    rows["landing_max_gap_ms"] = {"value": median([r["max_gap_ms"] for r in runs]), "unit": "ms",
                                  "p99_gap_ms": median([r["p99_gap_ms"] for r in runs]),
                                  "ttft_ms": median([r["ttft_ms"] for r in runs]), "runs": runs,
                                  "token_budget": sizes.landing_budget, "streams": sizes.landing_streams}

    d, runs = landing("tpot-slo", ["--tpot-slo-ms", f"{sizes.tpot_slo_ms:g}"])
    cached.append(d.first_answer_s)
    cache_hits.append("cached profile from" in d.log_text())
    chosen = _log_int(d.log_text(), r"starting token budget (\d+), max_num_seqs (\d+)")
    ttft = median([r["ttft_ms"] for r in runs])
    rows["slo_landing"] = {"value": median([r["p99_gap_ms"] for r in runs]), "unit": "ms (p99 gap)",
                           "max_gap_ms": median([r["max_gap_ms"] for r in runs]), "ttft_ms": ttft,
                           "ttft_vs_alone": ttft / alone_ms if ttft and alone_ms else None,
                           "tpot_slo_ms": sizes.tpot_slo_ms, "chosen_token_budget": chosen[0] if chosen else None,
                           "chosen_max_num_seqs": chosen[1] if chosen else None, "runs": runs}

    # More starts for medians: cold ones with an empty cache each, cached ones on the main cache.
    for i in range(1, sizes.startup_repeats):
        d = start_daemon(args, f"cold-{i}", work / f"cache-cold-{i}", work, [])
        stop_daemon(d)
        cold.append(d.first_answer_s)
    for i in range(2, sizes.startup_repeats):
        d = start_daemon(args, f"cached-{i}", cache_dir, work, [])
        stop_daemon(d)
        cached.append(d.first_answer_s)
        cache_hits.append("cached profile from" in d.log_text())
    rows["startup_cold_s"] = {"value": median(cold), "unit": "s", "runs": cold}
    rows["startup_cached_s"] = {"value": median(cached), "unit": "s", "runs": cached, "cache_hits": cache_hits}
    return rows


def _fmt(row: dict[str, Any]) -> str:
    value = row.get("value")
    text = "-" if value is None else f"{value:.1f} {row['unit']}"
    extras = []
    for key in ("p99_gap_ms", "max_gap_ms", "steady_p99_gap_ms", "steady_max_gap_ms", "ttft_ms"):
        if row.get(key) is not None:
            extras.append(f"{key.replace('_ms', '').replace('_', ' ')} {row[key]:.0f} ms")
    if row.get("ttft_vs_alone") is not None:
        extras.append(f"TTFT {row['ttft_vs_alone']:.2f}x alone")
    if row.get("chosen_token_budget") is not None:
        extras.append(f"budget chosen {row['chosen_token_budget']}")
    if row.get("cache_hits") is not None:
        extras.append(f"cache hits {sum(row['cache_hits'])}/{len(row['cache_hits'])}")
    if row.get("kv_blocks") is not None:
        extras.append(f"KV {row['kv_blocks']} blocks of {row['block_size']}")
    return text + (f" ({', '.join(extras)})" if extras else "")


LABELS = {
    "single_stream_decode_tok_s": "single-stream decode, {decode_tokens} tokens",
    "concurrent_total_tok_s": "{streams} concurrent streams, {decode_tokens} tokens each, total",
    "prefill_tok_s": "{long_prompt}-token prompt alone, prefill rate",
    "landing_max_gap_ms": "max decode gap of {landing_streams} streams when a {long_prompt}-token prompt lands, "
                          "budget {landing_budget}",
    "slo_landing": "the same with --tpot-slo-ms {tpot_slo_ms:g} and no budget flag",
    "startup_cold_s": "process start to first answer, default flags, empty profile cache",
    "startup_cached_s": "process start to first answer, profile cached",
    "peak_rss_mb": "peak RSS, {streams} streams",
}


# Each goal of GOALS as a check on its row (None: nothing to check, the figure is reported).
CHECKS = {
    "single_stream_decode_tok_s": lambda r: r["value"] >= 125,
    "concurrent_total_tok_s": lambda r: r["value"] >= 560,
    "prefill_tok_s": lambda r: r["value"] >= 700,
    "landing_max_gap_ms": lambda r: r["value"] <= 350,
    "slo_landing": lambda r: (r.get("p99_gap_ms") or 0) <= 150 and (r.get("max_gap_ms") or 0) <= 225
    and (r.get("ttft_vs_alone") or 0) <= 1.3,
    "startup_cold_s": lambda r: r["value"] <= 30,
    "startup_cached_s": lambda r: r["value"] <= 10,
    "peak_rss_mb": None,
}


def verdicts(rows: dict[str, Any], judged: bool) -> dict[str, str]:
    """met / MISSED per goal; a quick or sim run's figures are shown, not judged (they measure the machinery)."""
    out = {}
    for key, check in CHECKS.items():
        row = rows.get(key) or {}
        if check is None or not judged:
            out[key] = "reported" if check is None else "not judged"
        elif row.get("value") is None:
            out[key] = "MISSED (not measured)"
        else:
            out[key] = "met" if check(row) else "MISSED"
    return out


def report(rows: dict[str, Any], sizes: Sizes, verdict: dict[str, str]) -> str:
    lines = ["| figure | stallfree | goal | verdict |", "|---|---|---|---|"]
    for key, label in LABELS.items():
        lines.append(f"| {label.format(**sizes.__dict__)} | {_fmt(rows[key])} | {GOALS[key]} | {verdict[key]} |")
    if rows.get("single_stream_bandwidth"):
        lines.append(f"\none stream reads {describe(rows['single_stream_bandwidth'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        from stallfree.bench.engine_compare import compare

        print(compare(args.compare))
        return 0
    if args.launch is not None and not args.launch:
        print("stallfree bench engine: error: --launch needs a command", file=sys.stderr)
        return 2
    if args.launch and not args.url:
        print("stallfree bench engine: error: --launch needs --url (where the command serves)", file=sys.stderr)
        return 2
    sizes = QUICK if args.quick else Sizes()
    if args.repeats is not None or args.startup_repeats is not None:
        sizes = Sizes(**{**sizes.__dict__, "repeats": args.repeats or sizes.repeats,
                         "startup_repeats": args.startup_repeats or sizes.startup_repeats})
    if args.serving_rate is not None or args.serving_requests is not None:
        sizes = Sizes(**{**sizes.__dict__, "serving_rate": args.serving_rate or sizes.serving_rate,
                         "serving_requests": args.serving_requests or sizes.serving_requests})
    if sizes.repeats < 1 or sizes.startup_repeats < 1 or sizes.serving_rate <= 0 or sizes.serving_requests < 1:
        print("stallfree bench engine: error: --repeats, --startup-repeats and --serving-requests must be >= 1, "
              "--serving-rate > 0", file=sys.stderr)
        return 2
    if args.serving_only and not args.url:
        print("stallfree bench engine: error: --serving-only needs --url", file=sys.stderr)
        return 2
    if args.url:
        return main_url(args, sizes)
    print(f"bench engine: {args.model} ({args.backend} backend){' quick' if args.quick else ''}, one daemon at a "
          f"time, temperature 0, medians of {sizes.repeats}", flush=True)
    with tempfile.TemporaryDirectory(prefix="stallfree-bench-engine-") as tmp:
        work = Path(tmp)
        try:
            rows = measure(args, sizes, work)
        except RuntimeError as exc:
            print(f"stallfree bench engine: error: {exc}", file=sys.stderr)
            return 1
        finally:
            _keep_logs(work, args.keep_logs)
        paths = paths_from_logs(work)
    verdict = verdicts(rows, judged=not args.quick and args.backend == "model")
    print(report(rows, sizes, verdict))
    result = {"benchmark": "engine", "model": args.model, "backend": args.backend, "quick": args.quick,
              "sizes": sizes.__dict__, "goals": GOALS, "verdicts": verdict, "rows": rows, "threads": os.cpu_count(),
              "cpu": cpu_record(), "cpu_paths": paths, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    missed = [key for key, v in verdict.items() if v.startswith("MISSED")]
    if missed:
        print(f"missed {len(missed)} goal(s): {', '.join(missed)}")
    return 1 if missed else 0


def _keep_logs(work: Path, dest: str | None) -> None:
    if dest:
        keep = Path(dest)
        keep.mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.log"):
            (keep / log.name).write_bytes(log.read_bytes())


def main_url(args: argparse.Namespace, sizes: Sizes) -> int:
    from stallfree.bench import engine_url

    label = args.label or args.model
    print(f"bench engine: {label} at {args.url}, temperature 0, medians of {sizes.repeats}", flush=True)
    with tempfile.TemporaryDirectory(prefix="stallfree-bench-engine-") as tmp:
        work = Path(tmp)
        try:
            rows = engine_url.measure(args, sizes, work, say=lambda text: print(text, flush=True))
        except (RuntimeError, httpx.HTTPError) as exc:
            print(f"stallfree bench engine: error: {exc}", file=sys.stderr)
            return 1
        finally:
            _keep_logs(work, args.keep_logs)
        paths = paths_from_logs(work)  # a launched stallfree daemon's; none for other servers
    print(engine_url.report(rows, sizes, label))
    result = {"benchmark": "engine", "mode": "url", "label": label, "url": args.url, "model": args.model,
              "launch": args.launch, "quick": args.quick, "sizes": sizes.__dict__, "rows": rows,
              "loadavg": os.getloadavg(), "cpu": cpu_record(), "cpu_paths": paths,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
