"""`stallfree bench hostile`: what large structured bodies do to everyone else, on a daemon or through a router.

Streams decode and a prober asks /health every 20 ms; then each body is sent, one at a time: 1.33 M token
ids (4 MB) and 100k short chat messages (3.5 MB), the largest bodies the JSON
bounds let through (262k token ids, 2048 messages), and response_format schemas of 16,000 and 7,000 properties. For each it prints the answer's status and time, the
other streams' largest inter-token gap and /health's slowest answer while the body was in flight (and just
after), beside a quiet window. Exits 1 when any body's gap or /health latency passes --goal-ms.

Then the doors (hostile_doors.py): deep nesting, a 100 MB body, slowloris, paths outside the
OpenAI API, clients that leave, what a client learns of the replicas, and with --target router the demand
counted from refused requests and a replica hung with SIGSTOP.

Without --url it starts its own daemon (`stallfree serve`, sim backend unless told), or with --target router
two daemons and `stallfree router` in front of them. The client runs in this process, the servers in others: a
busy machine inflates the figures, never hides a stall.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx

from stallfree.bench.daemon_process import start, stop, wait_ready
from stallfree.bench.hostile_doors import Target, check_doors, print_doors
from stallfree.net import free_port
from stallfree.http_doors.json_bounds import MAX_JSON_VALUES
from stallfree.node_daemon.server.protocol import MAX_MESSAGES

PROBE_EVERY_S = 0.02
AFTER_S = 0.25  # a stall shows as the first gap after the answer too: the window runs this long past it


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree bench hostile", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a live daemon (or router); default: start them with the flags below")
    p.add_argument("--target", choices=["daemon", "router"], default="daemon",
                   help="router: two daemons and `stallfree router` in front, every request through the router")
    p.add_argument("--router-arg", action="append", default=[], help="extra flag for the router (repeatable)")
    p.add_argument("--no-doors", action="store_true", help="only the body table, not the doors")
    p.add_argument("--model", default="llama-3-8b", help="model of the daemon started here (also the request model)")
    p.add_argument("--backend", choices=["model", "sim"], default="sim")
    p.add_argument("--serve-arg", action="append", default=[], help="extra flag for the daemon (repeatable)")
    p.add_argument("--streams", type=int, default=4, help="streams decoding while the bodies arrive")
    p.add_argument("--goal-ms", type=float, default=100.0, help="the largest gap and /health latency allowed")
    p.add_argument("--quiet-s", type=float, default=1.0, help="the quiet window measured first")
    p.add_argument("--json", default="runs/bench_hostile.json")
    return p


def hostile_bodies(model: str) -> list[tuple[str, str, bytes]]:
    """(name, path, raw body) of each body sent, serialized up front so the client does no such work mid-run."""
    rng = random.Random(0)
    chat = {"role": "user", "content": "hi"}
    completion, chat_completion = "/v1/completions", "/v1/chat/completions"
    bodies = [
        ("1.33M token ids", completion,
         {"model": model, "prompt": [rng.randrange(10) for _ in range(1_330_000)], "max_tokens": 2}),
        ("100k messages", chat_completion, {"model": model, "messages": [chat] * 100_000, "max_tokens": 2}),
        (f"{MAX_JSON_VALUES - 16} token ids (within bounds)", completion,
         {"model": model, "prompt": [rng.randrange(1000, 30000) for _ in range(MAX_JSON_VALUES - 16)], "max_tokens": 2}),
        (f"{MAX_MESSAGES} messages (within bounds)", chat_completion,
         {"model": model, "messages": [chat] * MAX_MESSAGES, "max_tokens": 2}),
        # A schema is checked in more than linear time (16,000 properties: ~14 s): past the grammar bound it is a
        # 400 at once; within it, it is checked on the grammar workers while the streams go on.
        ("json_schema of 16,000 properties", chat_completion, _schema_body(model, chat, 16_000)),
        ("json_schema of 7,000 properties (within bounds)", chat_completion, _schema_body(model, chat, 7_000)),
    ]
    return [(name, path, json.dumps(body).encode()) for name, path, body in bodies]


def _schema_body(model: str, chat: dict, num_properties: int) -> dict:
    schema = {"type": "object", "properties": {f"p{i:05d}": {"type": "string"} for i in range(num_properties)}}
    return {"model": model, "messages": [chat], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}}


async def _stream(client: httpx.AsyncClient, model: str, index: int, stop_: asyncio.Event,
                  gaps: list[tuple[float, float]]) -> None:
    """Streaming completions one after another; (arrival, gap since the previous event) within each."""
    while not stop_.is_set():
        body = {"model": model, "prompt": f"stream {index}: a long story", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"stream {index}: HTTP {response.status_code}")
            last = None
            async for line in response.aiter_lines():
                if stop_.is_set():
                    return
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now, now - last))
                last = now


async def _probe(client: httpx.AsyncClient, stop_: asyncio.Event, latencies: list[tuple[float, float]]) -> None:
    """(start, seconds) of a /health call every PROBE_EVERY_S."""
    while not stop_.is_set():
        start = time.perf_counter()
        response = await client.get("/health")
        latencies.append((start, time.perf_counter() - start))
        if response.status_code != 200:
            raise RuntimeError(f"/health answered {response.status_code}")
        await asyncio.sleep(PROBE_EVERY_S)


def _window(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    inside = [value for at, value in samples if start <= at <= end]
    return round(1000 * max(inside), 1) if inside else None


def _probes_overlapping(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """The slowest /health call in flight at any time in [start, end]: one begun before a fast body still counts."""
    inside = [value for at, value in samples if at <= end and at + value >= start]
    return round(1000 * max(inside), 1) if inside else None


async def measure(url: str, model: str, streams: int, quiet_s: float,
                  bodies: list[tuple[str, str, bytes]]) -> list[dict]:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        stop_ = asyncio.Event()
        gaps: list[tuple[float, float]] = []
        health: list[tuple[float, float]] = []
        tasks = [asyncio.ensure_future(_stream(client, model, i, stop_, gaps)) for i in range(streams)]
        tasks.append(asyncio.ensure_future(_probe(client, stop_, health)))
        try:
            while len(gaps) < 4 * streams:  # every stream decoding
                await asyncio.sleep(0.05)
                _raise_if_failed(tasks)
            start = time.perf_counter()
            await asyncio.sleep(quiet_s)
            rows = [{"body": "quiet (no body)", "bytes": 0, "status": None, "took_ms": None,
                     "max_gap_ms": _window(gaps, start, start + quiet_s),
                     "health_max_ms": _window(health, start, start + quiet_s)}]
            for name, path, raw in bodies:
                start = time.perf_counter()
                response = await client.post(path, content=raw, headers={"content-type": "application/json"})
                answered = time.perf_counter()
                await asyncio.sleep(AFTER_S)
                _raise_if_failed(tasks)
                code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
                rows.append({"body": name, "bytes": len(raw), "status": response.status_code, "code": code,
                             "took_ms": round(1000 * (answered - start), 1),
                             "max_gap_ms": _window(gaps, start, answered + AFTER_S),
                             # A body answered in 9 ms may fall between two probes: the window runs past it.
                             "health_max_ms": _probes_overlapping(health, start, answered + AFTER_S)})
            return rows
        finally:
            stop_.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _raise_if_failed(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()


def _start_daemon(args: argparse.Namespace, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "stallfree.cli", "serve", "--model", args.model, "--backend", args.backend,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args.serve_arg]
    process, log_path = start(cmd, env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(process, url, timeout_s=300, poll_s=0.2, log_path=log_path)
    return process, url


def _start_router(args: argparse.Namespace, env: dict[str, str], replica_urls: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # A stall timeout a run can wait for: the hung-replica door measures it.
    cmd = [sys.executable, "-m", "stallfree.cli", "router", "--replicas", ",".join(replica_urls), "--host",
           "127.0.0.1", "--port", str(port), "--log-level", "warning", "--stream-stall-timeout-s", "5",
           *args.router_arg]
    process, log_path = start(cmd, env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(process, url, timeout_s=60, poll_s=0.2, log_path=log_path)
    return process, url


def _print(rows: list[dict], goal_ms: float) -> bool:
    """Print the table; True when every body kept both figures under the goal."""
    print(f"{'body':<34} {'MB':>5} {'status':>7} {'took ms':>8} {'max gap ms':>11} {'/health max ms':>15}")
    met = True
    for row in rows:
        status = "-" if row["status"] is None else f"{row['status']}"
        took = "-" if row["took_ms"] is None else f"{row['took_ms']:.0f}"
        gap = "-" if row["max_gap_ms"] is None else f"{row['max_gap_ms']:.1f}"
        health = "-" if row["health_max_ms"] is None else f"{row['health_max_ms']:.1f}"
        print(f"{row['body']:<34} {row['bytes'] / 1e6:>5.2f} {status:>7} {took:>8} {gap:>11} {health:>15}"
              + (f"  ({row['code']})" if row.get("code") else ""))
        if row["status"] is not None:
            met &= all(v is not None and v < goal_ms for v in (row["max_gap_ms"], row["health_max_ms"]))
    print(f"goal: other streams' largest gap and /health under {goal_ms:g} ms for every body: "
          f"{'met' if met else 'MISSED'}")
    return met


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    bodies = hostile_bodies(args.model)
    processes: list[subprocess.Popen] = []
    token = os.environ.get("STALLFREE_ADMIN_TOKEN") or secrets.token_hex(16)
    env = dict(os.environ, STALLFREE_ADMIN_TOKEN=token)
    router = args.target == "router"
    doors: list[dict] = []
    try:
        if args.url is not None:
            url, replica_urls = args.url, [] if router else [args.url]  # a live router's replicas are unknown here
        else:
            replica_urls = []
            for _ in range(2 if router else 1):
                process, daemon_url = _start_daemon(args, env)
                processes.append(process)
                replica_urls.append(daemon_url)
            url = replica_urls[0]
            if router:
                process, url = _start_router(args, env, replica_urls)
                processes.append(process)
        rows = asyncio.run(measure(url, args.model, args.streams, args.quiet_s, bodies))
        if not args.no_doors:
            pids = [p.pid for p in processes[:2]] if router and args.url is None else []
            doors = asyncio.run(check_doors(Target(url, args.model, router, replica_urls, pids, token)))
    finally:
        for process in reversed(processes):
            stop(process)
    print(f"target: {args.target} at {url}")
    met = _print(rows, args.goal_ms)
    if doors:
        print_doors(doors, args.target)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"url": args.url, "target": args.target, "model": args.model, "streams": args.streams,
                               "goal_ms": args.goal_ms, "met": met, "rows": rows, "doors": doors}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
