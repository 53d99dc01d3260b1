#!/usr/bin/env python3
"""The engine end to end on the GPU, after gpu_check.py: `stallfree serve` with random weights, one chat, its
metrics, greedy completions again with `--speculative ngram` (the same text: drafts verified as decode rows on the
GPU's attention), then `stallfree bench engine --quick` rows. Same report as the GPU check (one table, JSON, exit 1 unless
every row passed). Needs `stallfree` importable in child processes (run_on_gpu.sh installs the checkout).

    python3 e2e/gpu/serve_check.py --device cuda --bench          # on the GPU (run_on_gpu.sh)
    python3 e2e/gpu/serve_check.py --device cpu --model tiny      # anywhere: serve, one chat, metrics
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_report import Report  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--model", default="llama-3-8b", help="a shape name: random weights, byte-level tokenizer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--ready-timeout-s", type=float, default=120.0)
    p.add_argument("--bench", action="store_true", help="then `bench engine --quick` (three daemon starts)")
    p.add_argument("--bench-timeout-s", type=float, default=240.0)
    p.add_argument("--json", default=None, help="default $OUT/serve_check.json when OUT is set")
    args = p.parse_args(argv)
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "serve_check.json")
    return args


def serve_flags(args) -> list[str]:
    flags = ["--device", args.device, "--max-model-len", str(args.max_model_len)]
    if args.device == "cuda":  # bf16; 11 decode-graph buckets (up to 64 sequences) keep each start short
        flags += ["--dtype", "bfloat16", "--max-num-seqs-ceiling", "64"]
    return flags


# Greedy completions whose answers repeat their prompt (so n-gram drafts are proposed), asked of both daemons.
ECHO_PROMPTS = ["one two three four one two three four one two three four one two",
                "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("]


def greedy_answers(url: str, model: str) -> list[dict]:
    import httpx

    answers = []
    for prompt in ECHO_PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
        answers.append(httpx.post(url + "/v1/completions", json=body, timeout=120).json())
    return answers


def serve_section(report: Report, args, greedy: list[dict]) -> None:
    import httpx

    from stallfree.bench.daemon_process import start, stop
    from stallfree.net import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "stallfree.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), *serve_flags(args)]
    started = time.monotonic()
    process, log_path = start(cmd)
    try:
        if not _ready(report, "serve ready", process, url, log_path, args, started):
            return
        body = {"model": args.model, "messages": [{"role": "user", "content": "Say hello in five words."}],
                "max_tokens": 16, "temperature": 0.0}
        t0 = time.monotonic()
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        ms = (time.monotonic() - t0) * 1e3
        ok = answer.status_code == 200
        data = answer.json() if ok else {}
        tokens = data.get("usage", {}).get("completion_tokens", 0)
        content = (data.get("choices") or [{}])[0].get("message", {}).get("content")
        report.correct("one chat completion", f"HTTP {answer.status_code}, {tokens} tokens in {ms:.0f} ms",
                       ok and tokens > 0 and isinstance(content, str), "200, a message, tokens > 0", ms=ms)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        report.correct("metrics after the chat", f"{len(metrics.splitlines())} lines", "stallfree" in metrics,
                       "stallfree series exported")
        greedy.extend(greedy_answers(url, args.model))
    finally:
        stop(process)


def speculation_section(report: Report, args, greedy: list[dict]) -> None:
    """The same greedy completions from a daemon with `--speculative ngram`: the same text, drafts verified."""
    from stallfree.bench.daemon_process import start, stop
    from stallfree.net import free_port

    if len(greedy) != len(ECHO_PROMPTS):
        report.correct("greedy identical with speculation", "no answers from the serve section", False,
                       "the same text as without speculation")
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "stallfree.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--speculative", "ngram", *serve_flags(args)]
    started = time.monotonic()
    process, log_path = start(cmd)
    try:
        if not _ready(report, "serve --speculative ngram ready", process, url, log_path, args, started):
            return
        answers = greedy_answers(url, args.model)
        texts = [a.get("choices", [{}])[0].get("text") for a in answers]
        same = all(isinstance(t, str) for t in texts) and \
            texts == [g.get("choices", [{}])[0].get("text") for g in greedy]
        report.correct("greedy identical with speculation", f"{sum(map(bool, texts))} of {len(texts)} answers",
                       same, "the same text as without speculation")
        spec = [a.get("usage", {}).get("speculation") or {} for a in answers]
        report.info("speculation drafts", f"{sum(s.get('accepted_tokens', 0) for s in spec)} of "
                                          f"{sum(s.get('draft_tokens', 0) for s in spec)} drafted tokens accepted")
    finally:
        stop(process)


def _ready(report: Report, check: str, process, url: str, log_path, args, started: float) -> bool:
    from stallfree.bench.daemon_process import wait_ready

    try:
        wait_ready(process, url, args.ready_timeout_s, log_path=log_path)
    except RuntimeError as exc:
        report.correct(check, str(exc)[-400:], False, f"/ready 200 within {args.ready_timeout_s:.0f} s")
        return False
    report.correct(check, f"{time.monotonic() - started:.1f} s after start", True,
                   f"/ready 200 within {args.ready_timeout_s:.0f} s")
    return True


def bench_section(report: Report, args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench_engine.json")
        cmd = [sys.executable, "-m", "stallfree.cli", "bench", "engine", "--model", args.model, "--quick",
               "--output", out, *[f"--serve-arg={f}" for f in serve_flags(args)]]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout_s)
        except subprocess.TimeoutExpired:
            report.correct("bench engine --quick", f"over {args.bench_timeout_s:.0f} s", False, "completes")
            return
        if done.returncode != 0:
            report.correct("bench engine --quick", (done.stderr or done.stdout)[-400:], False, "completes")
            return
        rows = json.load(open(out))["rows"]
        report.correct("bench engine --quick", f"{len(rows)} rows", bool(rows), "completes")
        for name, row in rows.items():
            value = row.get("value") if isinstance(row, dict) else row
            unit = row.get("unit", "") if isinstance(row, dict) else ""
            report.info(f"bench {name}", f"{value:.1f} {unit}" if isinstance(value, float) else f"{value} {unit}")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "bench_engine.json"), "w") as f:
                json.dump(rows, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = Report(budget_s=2 * args.ready_timeout_s + args.bench_timeout_s + 180)
    greedy: list[dict] = []
    report.run("serve", 0, lambda: serve_section(report, args, greedy))
    report.run("speculation", 0, lambda: speculation_section(report, args, greedy))
    asked = ["serve", "speculation"]
    if args.bench:
        report.run("bench_engine", 0, lambda: bench_section(report, args))
        asked.append("bench_engine")
    return report.finish(asked, args.json)


if __name__ == "__main__":
    sys.exit(main())
