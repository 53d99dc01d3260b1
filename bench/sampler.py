"""`stallfree bench sampler`: microseconds per decode step spent in the sampler, by batch size and mix.

Logits are random rows of SmolLM2's vocabulary (49,152), scaled so the distribution is peaked like a real
model's (a top-p of 0.9 keeps tens to hundreds of tokens). Each mix is timed for batches of 1, 16 and 64
rows; the first steps are warm-up, the figure is the median of the timed steps (and the p90).
Mixes: all greedy; greedy with one top-p row; all top-p; all top-k; greedy with penalties (repetition,
frequency and presence over 256 generated tokens); greedy with one row asking for 5 logprobs.
A mix the sampler cannot run (an older build without penalties) prints "unsupported".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from stallfree.node_daemon.engine.sampler import Sampler
from stallfree.node_daemon.engine.sampling_params import SamplingParams

VOCAB = 49152


@dataclass
class _History:
    """What the sampler reads for penalties: the request's prompt and generated token ids."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stallfree bench sampler", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=60, help="timed steps per (mix, batch size)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    return p.parse_args(argv)


def _mixes(batch: int) -> dict[str, list[dict]]:
    greedy = {"temperature": 0.0}
    top_p = {"temperature": 0.8, "top_p": 0.9}
    penalties = {"temperature": 0.0, "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.3}
    return {
        "greedy": [greedy] * batch,
        "greedy+1 top-p": [top_p] + [greedy] * (batch - 1),
        "top-p 0.9": [top_p] * batch,
        "top-k 50": [{"temperature": 0.8, "top_k": 50}] * batch,
        "penalties": [penalties] * batch,
        "greedy+1 logprobs": [{"temperature": 0.0, "logprobs": 5}] + [greedy] * (batch - 1),
    }


def _params(fields: dict) -> SamplingParams | None:
    try:
        return SamplingParams(max_tokens=1 << 20, **fields)
    except TypeError:  # a field this build's SamplingParams does not have
        return None


def _time_mix(sampler: Sampler, rows: list[dict], vocab: int, warmup: int, steps: int) -> dict | None:
    params = [_params(f) for f in rows]
    if any(p is None for p in params):
        return None
    ids = [f"r{i}" for i in range(len(rows))]
    gen = torch.Generator().manual_seed(0)
    histories = [_History(torch.randint(vocab, (64,), generator=gen).tolist(),
                          torch.randint(vocab, (256,), generator=gen).tolist()) for _ in rows]
    logits = [torch.randn(len(rows), vocab, generator=gen) * 4 for _ in range(4)]
    uses_history = any(getattr(p, "needs_history", False) for p in params)
    times = []
    for step in range(warmup + steps):
        x = logits[step % len(logits)]
        start = time.perf_counter()
        if uses_history:
            sampler.sample(x, params, ids, histories)
        else:
            sampler.sample(x, params, ids)
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed * 1e6)
        for h in histories:  # generation goes on: the penalised history grows by one token per step
            h.output_token_ids.append(step % vocab)
    times.sort()
    return {"median_us": statistics.median(times), "p90_us": times[int(0.9 * (len(times) - 1))]}


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"sampler time per decode step (vocab {args.vocab}, {args.steps} steps after {args.warmup} warm-up, "
          f"{torch.get_num_threads()} threads): median us (p90)", flush=True)
    results: list[dict] = []
    names = list(_mixes(1))
    header = f"{'mix':<20}" + "".join(f"{'batch ' + str(b):>22}" for b in args.batch_sizes)
    print(header, flush=True)
    for name in names:
        cells = []
        for batch in args.batch_sizes:
            figures = _time_mix(Sampler(), _mixes(batch)[name], args.vocab, args.warmup, args.steps)
            results.append({"mix": name, "batch": batch, **(figures or {"unsupported": True})})
            cells.append("unsupported" if figures is None
                         else f"{figures['median_us']:.0f} ({figures['p90_us']:.0f})")
        print(f"{name:<20}" + "".join(f"{c:>22}" for c in cells), flush=True)
    base = {r["batch"]: r["median_us"] for r in results if r["mix"] == "greedy"}
    mixed = {r["batch"]: r.get("median_us") for r in results if r["mix"] == "greedy+1 top-p"}
    for batch in args.batch_sizes:
        if mixed.get(batch) is not None and base.get(batch):
            print(f"one top-p row in a greedy batch of {batch}: {mixed[batch] / base[batch]:.2f}x the greedy step "
                  f"(+{mixed[batch] - base[batch]:.0f} us)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": args.vocab, "threads": torch.get_num_threads(), "results": results}, f, indent=2)
        print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
