"""`stallfree bench itl`: client-seen against engine-side inter-token latency at 64 concurrent streams.

The engine stamps each token when its iteration ends (the stats window's exact ITL); the client stamps
each SSE event when it arrives. Their p99 difference is what the HTTP side adds: detokenized text turned
into events, the hand-off from the engine thread to the event loop, the socket. The client is a lean
asyncio HTTP/1.1 reader (no client library in the measurement), all streams in one event loop.

Without --url the benchmark starts its own daemon (`stallfree serve`, a fresh stats window), so the
engine-side figures cover exactly the benchmark's requests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from stallfree.bench.daemon_process import start, stop, wait_ready
from stallfree.contracts import percentile
from stallfree.net import free_port


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree bench itl", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a live daemon; default: start one with the flags below")
    p.add_argument("--admin-token", default=None, help="its admin token (else env STALLFREE_ADMIN_TOKEN)")
    p.add_argument("--model", default="llama-3-8b", help="model of the daemon started here (also the request model)")
    p.add_argument("--backend", choices=["model", "sim"], default="sim")
    p.add_argument("--hardware", default="h100", help="sim backend: hardware preset")
    p.add_argument("--device", default="auto")
    p.add_argument("--serve-arg", action="append", default=[], help="extra flag for the daemon (repeatable)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per stream")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="requests per stream, one after another")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", default="runs/bench_itl.json")
    return p


def _percentiles(samples: list[float]) -> dict[str, float | int | None]:
    """Exact nearest-rank percentiles (ms), as the stats window computes them."""
    if not samples:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(samples)
    return {"count": len(ordered), "p50": percentile(ordered, 0.5), "p90": percentile(ordered, 0.9),
            "p99": percentile(ordered, 0.99), "max": ordered[-1]}


async def _one_stream(host: str, port: int, model: str, prompt: list[int], max_tokens: int) -> dict:
    """POST a streaming completion over a raw socket; arrival time of every content event."""
    # continuous_usage_stats: each event says how many tokens it carries (a held-back partial UTF-8
    # character or a slow reader puts several tokens in one event).
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0.0,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    sent = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        rest = await reader.read()
        writer.close()
        raise RuntimeError(f"HTTP {status.decode().strip()}: {rest[-300:].decode(errors='replace')}")
    chunked = False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
            chunked = True
    arrivals: list[float] = []
    tokens: list[int] = []  # completion tokens so far, at each arrival
    buffer = b""
    finished = False
    while not finished:
        if chunked:
            size_line = await reader.readline()
            if not size_line:
                break
            size = int(size_line.strip() or b"0", 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            now = time.perf_counter()
            buffer += data[:-2]
        else:
            data = await reader.read(65536)
            now = time.perf_counter()
            if not data:
                break
            buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if event == b"data: [DONE]":
                finished = True
                break
            payload = json.loads(event[len(b"data: "):])
            if "error" in payload:
                raise RuntimeError(f"stream error: {payload['error']['message']}")
            if payload["choices"] and payload["choices"][0]["text"]:
                arrivals.append(now)
                tokens.append(payload["usage"]["completion_tokens"])
    writer.close()
    return {"sent": sent, "arrivals": arrivals, "tokens": tokens, "events": len(arrivals)}


async def _run_load(url: str, model: str, streams: int, rounds: int, prompt_tokens: int, max_tokens: int,
                    vocab_hi: int) -> list[dict]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    rng = random.Random(0)

    async def client(index: int) -> list[dict]:
        out = []
        for r in range(rounds):
            # Distinct prompts: no prefix-cache hit makes one stream's prefill cheaper than another's.
            prompt = [rng.randrange(16, vocab_hi) for _ in range(prompt_tokens)]
            out.append(await _one_stream(host, port, model, prompt, max_tokens))
        return out

    results = await asyncio.gather(*(client(i) for i in range(streams)))
    return [r for per_client in results for r in per_client]


def _start_daemon(args: argparse.Namespace, token: str, window_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "stallfree.cli", "serve", "--model", args.model, "--backend", args.backend,
           "--hardware", args.hardware, "--device", args.device, "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(max(args.streams, 1)), "--max-num-seqs-ceiling", str(max(args.streams, 256)),
           "--stats-window-s", str(window_s), "--log-level", "warning", *args.serve_arg]
    env = dict(os.environ, STALLFREE_ADMIN_TOKEN=token)
    process, log_path = start(cmd, env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(process, url, timeout_s=300, poll_s=0.2, log_path=log_path)
    return process, url


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.streams < 1 or args.max_tokens < 2 or args.prompt_tokens < 1 or args.rounds < 1:
        print("stallfree bench itl: error: --streams, --prompt-tokens, --rounds >= 1 and --max-tokens >= 2",
              file=sys.stderr)
        return 2
    process = None
    token = args.admin_token or os.environ.get("STALLFREE_ADMIN_TOKEN") or "bench-itl"
    url = args.url
    try:
        if url is None:
            process, url = _start_daemon(args, token, window_s=args.timeout_s + 60)
        headers = {"Authorization": f"Bearer {token}"}
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        model = models[0]["id"]
        vocab_hi = 250  # byte-range ids: valid for every model's vocabulary
        started = time.perf_counter()
        results = asyncio.run(asyncio.wait_for(
            _run_load(url, model, args.streams, args.rounds, args.prompt_tokens, args.max_tokens, vocab_hi),
            timeout=args.timeout_s))
        took = time.perf_counter() - started
        stats = httpx.get(url + "/admin/stats", headers=headers, timeout=30).json()
    finally:
        stop(process)

    # Every gap between events, and the gaps before events that carry exactly one new token: those compare
    # one to one with the engine's per-token ITL (a multi-token event's gap spans several engine gaps).
    event_gaps = [(b - a) * 1000.0 for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    client_itl = [(r["arrivals"][i] - r["arrivals"][i - 1]) * 1000.0 for r in results
                  for i in range(1, len(r["arrivals"])) if r["tokens"][i] - r["tokens"][i - 1] == 1]
    client_ttft = [(r["arrivals"][0] - r["sent"]) * 1000.0 for r in results if r["arrivals"]]
    events = sum(r["events"] for r in results)
    client = _percentiles(client_itl)
    gaps = _percentiles(event_gaps)
    engine = stats["itl_ms"]

    def minus(a: dict, b: dict) -> dict:
        return {k: (a[k] - b[k]) if a[k] is not None and b[k] is not None else None for k in ("p50", "p99", "max")}

    diff = minus(client, engine)
    report = {
        "url": args.url or f"spawned: {args.backend} {args.model}" + (f" on {args.hardware}" if args.backend == "sim"
                                                                     else f" on {args.device}"),
        "model": model, "streams": args.streams, "rounds": args.rounds, "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens, "seconds": took,
        "output_tokens_per_s": args.streams * args.rounds * args.max_tokens / took,
        # Several tokens in one event mean the client fell behind the engine (the server merges updates).
        "events_per_output_token": events / (args.streams * args.rounds * args.max_tokens),
        "client_itl_ms": client, "client_event_gap_ms": gaps, "engine_itl_ms": engine, "itl_overhead_ms": diff,
        "event_gap_overhead_ms": minus(gaps, engine),
        "client_ttft_ms": _percentiles(client_ttft), "engine_ttft_ms": stats["ttft_ms"],
        "engine_mean_iteration_ms": stats["mean_iteration_ms"], "engine_iterations": stats["iterations"],
    }
    print(f"{args.streams} streams x {args.rounds} x {args.max_tokens} tokens against {report['url']} "
          f"in {took:.1f}s ({report['output_tokens_per_s']:.0f} tok/s, "
          f"{report['events_per_output_token']:.3f} events per token)")
    print(f"{'ITL ms':>14} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}")
    for name, row in (("client-seen", client), ("all events", gaps), ("engine-side", engine)):
        print(f"{name:>14} " + " ".join(f"{row[k]:9.2f}" if row[k] is not None else f"{'-':>9}"
                                         for k in ("p50", "p90", "p99", "max")))
    p99, p99_all = diff["p99"], report["event_gap_overhead_ms"]["p99"]
    if p99 is not None:
        print(f"API overhead (client p99 - engine p99): {p99:.2f} ms  (all event gaps: {p99_all:.2f} ms)")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0
