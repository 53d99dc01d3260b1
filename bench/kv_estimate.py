"""`stallfree bench kv-estimate`: chats without max_tokens against a real daemon, and a 2-token request behind them.

Most OpenAI clients send no max_tokens, so the server's bound is the whole remaining context. The
daemon reserves KV for an estimate of the output length instead (preempting by recompute when it is
short), so such chats run together up to max_num_seqs. This sends --chats streaming chat completions
without max_tokens (greedy), then, once the daemon holds them all, one request with max_tokens=2, and
prints: the concurrency reached (peak running requests, from /metrics), how many chats completed, the
peak reserved and used KV, preemptions, and the 2-token request's latency, also in engine iterations
from send to finish. Bounded by --timeout-s: chats still open then are cancelled and counted as not
completed.

Without --url it starts its own daemon (`stallfree serve --model smollm2-135m`, one model process) and
stops it at the end. Progress is printed every few seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from stallfree.bench.daemon_process import start, stop, wait_ready
from stallfree.loadgen.stream import StreamError, stream_events
from stallfree.net import free_port

QUESTIONS = (
    "What is the capital of France?", "Name a primary colour.", "What is two plus three?",
    "Which planet is closest to the sun?", "What is the color of grass?", "What is the opposite of hot?",
    "How many days are in a week?", "What colour is the sky on a clear day?", "What do fish live in?",
    "What is frozen water called?", "Which is larger, a cat or an elephant?", "How many wheels does a bicycle have?",
    "What is the boiling point of water in Celsius?", "Name a fruit that is yellow.", "What is the capital of Italy?",
    "How many legs does a spider have?", "What is the largest ocean?", "What language is spoken in Spain?",
    "What is the first month of the year?", "What shape has three sides?", "What is the capital of Japan?",
    "Which season comes after winter?", "What is the chemical symbol for gold?", "How many hours are in a day?",
    "What is the tallest animal?", "Which metal is liquid at room temperature?", "What is the sun?",
    "What do you call a baby dog?", "Name a musical instrument with keys.", "What is H2O?",
    "What is the square root of nine?", "Which bird cannot fly but swims well?",
)

# Questions SmolLM2-135M-Instruct answers greedily and then stops by itself (8 to 155 tokens here); some
# others ("What do bees make?") loop to the end of the context, which would bound the run by its timeout.
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


@dataclass
class Result:
    name: str
    sent_s: float = 0.0
    ok: bool = False
    finish_reason: str | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree bench kv-estimate", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a live daemon; default: start one with the flags below")
    p.add_argument("--model", default="smollm2-135m", help="model of the daemon started here")
    p.add_argument("--serve-arg", action="append", default=[], help="extra flag for the daemon (repeatable)")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the daemon started here (0: torch's default). One thread keeps iterations "
                        "steady on a shared machine, where spinning OpenMP workers slow every matmul many times over")
    p.add_argument("--chats", type=int, default=32, help="concurrent chat requests without max_tokens")
    p.add_argument("--short-max-tokens", type=int, default=2, help="max_tokens of the request sent behind them")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on the whole run")
    p.add_argument("--poll-s", type=float, default=0.2, help="how often /metrics is read")
    p.add_argument("--json", default="runs/bench_kv_estimate.json", help="where the figures are written")
    return p


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {name: value}, labels dropped (one model per daemon)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            values[match.group(1)] = float(match.group(3))
    return values


async def _metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    response = await client.get(url + "/metrics", timeout=10)
    response.raise_for_status()
    return parse_metrics(response.text)


async def _stream(client: httpx.AsyncClient, url: str, model: str, result: Result, content: str,
                  max_tokens: int | None, started: float) -> None:
    body: dict = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True,
                  "temperature": 0.0, "stream_options": {"include_usage": True}}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    start = time.perf_counter()
    result.sent_s = start - started
    try:
        async for event in stream_events(client, url + "/v1/chat/completions", body, timeout=None):
            if event.get("usage"):
                result.output_tokens = event["usage"].get("completion_tokens") or result.output_tokens
            for choice in event.get("choices") or []:
                if result.ttft_s is None and (choice.get("delta") or {}).get("content"):
                    result.ttft_s = time.perf_counter() - start
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
    except StreamError as exc:
        result.error = str(exc)
        return
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return
    result.latency_s = time.perf_counter() - start
    result.ok = result.finish_reason in ("stop", "length")


async def run(url: str, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.chats + 8, max_keepalive_connections=args.chats + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        model = (await client.get(url + "/v1/models", timeout=10)).json()["data"][0]["id"]
        before = await _metrics(client, url)
        started = time.perf_counter()
        peak = {"running": 0.0, "waiting": 0.0, "kv_reserved": 0.0, "kv_usage": 0.0}
        chats = [Result(f"chat-{i}") for i in range(args.chats)]
        tasks = [asyncio.create_task(_stream(client, url, model, r, QUESTIONS[i % len(QUESTIONS)], None, started))
                 for i, r in enumerate(chats)]
        short = Result("short")
        short_iterations: float | None = None
        stop = asyncio.Event()

        async def poll() -> None:
            last_print = 0.0
            while not stop.is_set():
                m = await _metrics(client, url)
                peak["running"] = max(peak["running"], m.get("stallfree_num_requests_running", 0.0))
                peak["waiting"] = max(peak["waiting"], m.get("stallfree_num_requests_waiting", 0.0))
                peak["kv_reserved"] = max(peak["kv_reserved"], m.get("stallfree_kv_cache_reserved_ratio", 0.0))
                peak["kv_usage"] = max(peak["kv_usage"], m.get("stallfree_kv_cache_usage_ratio", 0.0))
                now = time.perf_counter() - started
                if now - last_print >= 5.0:
                    last_print = now
                    done = sum(1 for r in chats if r.latency_s is not None or r.error)
                    print(f"[{now:6.1f} s] running {m.get('stallfree_num_requests_running', 0):.0f}, waiting "
                          f"{m.get('stallfree_num_requests_waiting', 0):.0f}, KV used "
                          f"{m.get('stallfree_kv_cache_usage_ratio', 0):.0%}, reserved "
                          f"{m.get('stallfree_kv_cache_reserved_ratio', 0):.0%}, chats done {done}/{len(chats)}, "
                          f"2-token request {'done' if short.latency_s is not None else 'open'}", flush=True)
                try:
                    await asyncio.wait_for(stop.wait(), timeout=args.poll_s)
                except asyncio.TimeoutError:
                    pass

        poller = asyncio.create_task(poll())
        try:
            async with asyncio.timeout(args.timeout_s):
                # Behind them: once the daemon holds every chat (running or waiting), or a chat already ended.
                while True:
                    m = await _metrics(client, url)
                    held = m.get("stallfree_num_requests_running", 0) + m.get("stallfree_num_requests_waiting", 0)
                    if held >= args.chats or any(t.done() for t in tasks):
                        break
                    await asyncio.sleep(0.05)
                iterations_at_send = m.get("stallfree_iterations_total", 0.0)
                await _stream(client, url, model, short, "Say hello.", args.short_max_tokens, started)
                short_iterations = (await _metrics(client, url)).get("stallfree_iterations_total", 0.0) - \
                    iterations_at_send
                await asyncio.gather(*tasks)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            stop.set()
            await poller
        wall_s = time.perf_counter() - started
        after = await _metrics(client, url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    iterations = delta("stallfree_iterations_total")
    finish: dict[str, int] = {}
    for r in chats:
        key = r.finish_reason if r.ok else "not completed"
        finish[key] = finish.get(key, 0) + 1
    return {
        "url": url, "model": model, "chats": args.chats, "completed": sum(r.ok for r in chats), "finish": finish,
        "errors": [r.error for r in chats if r.error][:5],
        "chat_output_tokens": sorted(r.output_tokens for r in chats),
        "peak_running": peak["running"], "peak_waiting": peak["waiting"],
        "max_num_seqs": after.get("stallfree_max_num_seqs"),
        "peak_kv_reserved": peak["kv_reserved"], "peak_kv_usage": peak["kv_usage"],
        "preemptions": delta("stallfree_preemptions_total"), "evictions": delta("stallfree_kv_cache_evictions_total"),
        "iterations": iterations,
        "mean_iteration_ms": 1000 * delta("stallfree_iteration_time_seconds_sum") / iterations if iterations else None,
        "short": asdict(short), "short_iterations": short_iterations, "wall_s": wall_s,
    }


def _start_daemon(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "stallfree.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", *args.serve_arg]
    env = dict(os.environ, STALLFREE_ADMIN_TOKEN=os.environ.get("STALLFREE_ADMIN_TOKEN", "bench-kv-estimate"))
    if args.threads > 0:
        env["OMP_NUM_THREADS"] = str(args.threads)
    print(f"starting {' '.join(cmd[2:])} (model load and profile take a while) ...", flush=True)
    process, log_path = start(cmd, env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(process, url, timeout_s=600, poll_s=0.5, log_path=log_path)
    return process, url


def report(r: dict) -> str:
    short = r["short"]
    finish = ", ".join(f"{k} {v}" for k, v in sorted(r["finish"].items()))
    lat = f"{short['latency_s']:.2f} s" if short["latency_s"] is not None else f"failed ({short['error']})"
    mean_it = f"{r['mean_iteration_ms']:.0f} ms" if r["mean_iteration_ms"] else "n/a"
    out = r["chat_output_tokens"]
    return "\n".join([
        f"daemon {r['url']} model {r['model']}",
        f"chats without max_tokens: {r['chats']} sent, {r['completed']} completed ({finish}); output tokens "
        f"min {out[0] if out else 0} median {out[len(out) // 2] if out else 0} max {out[-1] if out else 0}",
        f"concurrency: peak running {r['peak_running']:.0f} (max_num_seqs {r['max_num_seqs'] or 0:.0f}), peak waiting "
        f"{r['peak_waiting']:.0f}; peak KV reserved {r['peak_kv_reserved']:.0%}, used {r['peak_kv_usage']:.0%}; "
        f"preemptions {r['preemptions']:.0f}, evicted blocks {r['evictions']:.0f}",
        f"{r['short']['name']} request (max_tokens=2): latency {lat}, {r['short_iterations']} iterations from send to "
        f"finish (mean iteration {mean_it}), finish {short['finish_reason']}",
        f"wall {r['wall_s']:.1f} s, {r['iterations']:.0f} iterations",
    ])


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.chats < 1 or args.short_max_tokens < 1:
        print("stallfree bench kv-estimate: error: --chats and --short-max-tokens must be >= 1", file=sys.stderr)
        return 2
    process = None
    try:
        url = args.url
        if url is None:
            process, url = _start_daemon(args)
        result = asyncio.run(run(url.rstrip("/"), args))
    finally:
        stop(process)
    print(report(result))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"figures written to {path}")
    return 0 if result["completed"] == result["chats"] and result["short"]["ok"] else 1
