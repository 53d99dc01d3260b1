"""`stallfree bench speculation --url URL`: output tokens/s and draft acceptance on a workload whose answers repeat
their context (copying a passage, a renamed function) and on one whose answers do not, against any
OpenAI-compatible server, so stallfree with `--speculative ngram` and off, and llama.cpp's `--spec-type ngram-*`
modes, are measured by one client.

Each request is a streamed /v1/completions call (temperature 0, `stream_options.include_usage`: the last
chunk's usage is read); `--streams` of them run at once, `--rounds` times over the workload's prompts. Figures per
workload: output tokens / wall time (all streams), the median request's output tokens / its end-to-end time, the
p50 and p99 TPOT (each request's time from its first token to its last over the tokens after the first, as the
daemon's own histogram counts it), and the acceptance the server reports: stallfree's usage.speculation,
llama.cpp's timings.draft_n and draft_n_accepted (none when the server reports none). `--tpot-slo-ms` is a goal:
a p99 TPOT over it exits 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from stallfree.contracts import percentile
from stallfree.latency import tpot_s

PASSAGES = [
    ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
     "metal type with an oil-based ink and a wooden screw press, so that books could be copied faster and more "
     "cheaply than ever before. Within fifty years presses were at work in more than two hundred European cities, "
     "and the price of a book fell so far that students, merchants and artisans could own one."),
    ("def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
     "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n"
     "            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
     "    result.extend(right[j:])\n    return result\n"),
    ("Photosynthesis takes place in the chloroplasts of plant cells. Light energy is absorbed by chlorophyll and used "
     "to split water molecules, releasing oxygen. The energy is stored in ATP and NADPH, which the Calvin cycle then "
     "uses to turn carbon dioxide from the air into sugars that the plant can store or burn."),
    ("SELECT customers.name, COUNT(orders.id) AS order_count, SUM(orders.total) AS revenue\nFROM customers\n"
     "JOIN orders ON orders.customer_id = customers.id\nWHERE orders.created_at >= '2024-01-01'\n"
     "GROUP BY customers.name\nHAVING COUNT(orders.id) > 3\nORDER BY revenue DESC\nLIMIT 20;\n"),
]

OPEN_TOPICS = ["a lighthouse keeper who finds a map", "why the sky changes colour at sunset",
               "a recipe for a winter soup", "the first day at a new school", "how a bicycle stays upright",
               "a city built under the sea", "advice for a beginner gardener", "the life of a honeybee"]


def echo_prompts() -> list[str]:
    """Copy a passage, or repeat a function with one name changed: the answer is mostly its context."""
    out = []
    for passage in PASSAGES:
        head = passage.split()[0]
        out.append(f"Copy the following text exactly.\n\nText:\n{passage}\n\nCopy:\n{head}")
    code = PASSAGES[1]
    out.append(f"{code}\n# The same function again, with `result` renamed to `merged`:\n"
               + code.replace("result", "merged").split("\n")[0] + "\n")
    return out


def open_prompts() -> list[str]:
    """Open-ended writing: the answer does not repeat the prompt."""
    return [f"Write a few paragraphs about {topic}.\n\n" for topic in OPEN_TOPICS]


WORKLOADS = {"echo": echo_prompts, "open": open_prompts}


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
              ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.monotonic()
    first = last = None
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}  # llama.cpp's server: on its last chunk
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices") or ()):
                last = time.monotonic()
                first = first if first is not None else last
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    elapsed = time.monotonic() - start
    tokens = int(usage.get("completion_tokens", 0))
    spec = usage.get("speculation") or {}
    drafted = spec.get("draft_tokens", timings.get("draft_n", 0)) or 0
    accepted = spec.get("accepted_tokens", timings.get("draft_n_accepted", 0)) or 0
    return {"tokens": tokens, "seconds": elapsed, "tpot_s": tpot_s(first, last, tokens), "drafted": int(drafted),
            "accepted": int(accepted)}


async def run_workload(url: str, model: str, prompts: list[str], streams: int, rounds: int, max_tokens: int,
                       ignore_eos: bool, timeout_s: float) -> dict[str, Any]:
    queue = [p for _ in range(rounds) for p in prompts]
    results: list[dict[str, Any]] = []
    # A connection per request: llama.cpp's server closes one after a streamed answer, which a reused connection
    # meets as "server disconnected"
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        await one(client, url, model, prompts[0], 8, ignore_eos)  # warm-up, not counted

        async def worker() -> None:
            while queue:
                prompt = queue.pop(0)
                results.append(await one(client, url, model, prompt, max_tokens, ignore_eos))

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.monotonic() - start
    tokens = sum(r["tokens"] for r in results)
    drafted = sum(r["drafted"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    tpots = sorted(r["tpot_s"] * 1000.0 for r in results if r["tpot_s"] is not None)
    return {
        "requests": len(results), "output_tokens": tokens, "wall_s": wall,
        "p50_tpot_ms": percentile(tpots, 0.5) if tpots else None,
        "p99_tpot_ms": percentile(tpots, 0.99) if tpots else None,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "median_request_tok_s": statistics.median(r["tokens"] / r["seconds"] for r in results if r["seconds"] > 0),
        "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stallfree bench speculation", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", required=True, help="the server's base URL (http://host:port)")
    p.add_argument("--model", default="", help="the `model` field sent (default: the first of /v1/models)")
    p.add_argument("--workload", choices=["echo", "open", "both"], default="both")
    p.add_argument("--streams", type=int, default=1, help="requests in flight at once")
    p.add_argument("--rounds", type=int, default=2, help="passes over the workload's prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (every request runs to max_tokens)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="a goal: every workload's p99 TPOT within it (exit 1 when missed)")
    p.add_argument("--label", default="", help="a name for this server's rows (e.g. 'spec on')")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.streams < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--streams, --rounds and --max-tokens must be positive")
    if args.tpot_slo_ms is not None and args.tpot_slo_ms <= 0:
        p.error("--tpot-slo-ms must be positive")
    names = ["echo", "open"] if args.workload == "both" else [args.workload]
    url = args.url.rstrip("/")
    model = args.model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    figures = {}
    for name in names:
        figures[name] = asyncio.run(run_workload(url, model, WORKLOADS[name](), args.streams, args.rounds,
                                                 args.max_tokens, args.ignore_eos, args.timeout_s))
    label = f"[{args.label}] " if args.label else ""
    missed = []
    for name, f in figures.items():
        acceptance = "n/a" if f["acceptance"] is None else f"{f['acceptance']:.2f} ({f['accepted_tokens']}/" \
                                                          f"{f['draft_tokens']} drafted)"
        tpot = "TPOT n/a" if f["p99_tpot_ms"] is None else \
            f"TPOT p50 {f['p50_tpot_ms']:.1f} ms, p99 {f['p99_tpot_ms']:.1f} ms"
        if args.tpot_slo_ms is not None:
            met = f["p99_tpot_ms"] is not None and f["p99_tpot_ms"] <= args.tpot_slo_ms
            tpot += f" (SLO {args.tpot_slo_ms:g} ms: {'met' if met else 'MISSED'})"
            if not met:
                missed.append(name)
        print(f"{label}{name:<5} {args.streams} stream(s): {f['output_tok_s']:7.1f} output tok/s, median request "
              f"{f['median_request_tok_s']:6.1f} tok/s, {tpot}, {f['requests']} requests, {f['output_tokens']} "
              f"tokens; acceptance {acceptance}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"label": args.label, "url": url, "streams": args.streams, "max_tokens": args.max_tokens,
                       "tpot_slo_ms": args.tpot_slo_ms, "workloads": figures}, fh, indent=2)
    if missed:
        print(f"{label}p99 TPOT over the SLO on: {', '.join(missed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
