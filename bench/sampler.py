"""`stallfree bench sampler`: microseconds per decode step spent in the sampler, by batch size and mix.

Logits are random rows of SmolLM2's vocabulary (49,152), scaled so the distribution is peaked like a real
model's (a top-p of 0.9 keeps tens to hundreds of tokens). Each mix is timed for batches of 1, 16 and 64
rows; the first steps are warm-up, the figure is the median of the timed steps (and the p90).
Mixes are interleaved step by step (noise from a busy machine falls on all alike). Mixes: all greedy; greedy with one top-p row; all top-p; all top-k; greedy with penalties (repetition,
frequency and presence over 256 generated tokens); greedy with one row asking for 5 logprobs.
A mix the sampler cannot run (an older build without penalties) prints "unsupported".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from stallfree.contracts import percentile
from stallfree.node_daemon.engine.sampler import Sampler
from stallfree.node_daemon.engine.sampling_params import SamplingParams

VOCAB = 49152


class _History:
    """What the sampler reads for penalties (sampler.TokenHistory): the prompt, then the generated token ids."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.token_ids = prompt + output
        self.num_prompt_tokens = len(prompt)

    # What an older sampler read instead (the bench also times older builds).
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stallfree bench sampler", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=60, help="timed steps per (mix, batch size)")
    p.add_argument("--device", default="cpu", help="where the logits live and the sampler runs (cpu, cuda)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    p.add_argument("--decode-step-ms", type=float, default=0.0,
                   help="the model's decode step at these batch sizes, to express the top-p row's cost in percent")
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


class _Mix:
    """One (mix, batch size) under test: its own sampler, params, growing histories and timings."""

    def __init__(self, rows: list[dict], vocab: int, gen: torch.Generator, device: torch.device) -> None:
        self.params = [_params(f) for f in rows]
        self.supported = all(p is not None for p in self.params)
        self.ids = [f"r{i}" for i in range(len(rows))]
        self.sampler = Sampler(device)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.histories = [_History(torch.randint(vocab, (64,), generator=gen).tolist(),
                                   torch.randint(vocab, (256,), generator=gen).tolist()) for _ in rows]
        self.uses_history = self.supported and any(getattr(p, "needs_history", False) for p in self.params)
        self.times: list[float] = []

    def step(self, logits: torch.Tensor, record: bool, token: int) -> None:
        start = time.perf_counter()
        if self.uses_history:
            self.sampler.sample(logits, self.params, self.ids, self.histories)
        else:
            self.sampler.sample(logits, self.params, self.ids)
        self.sync()  # .tolist() already waits for the device; this keeps the figure honest if that changes
        elapsed = time.perf_counter() - start
        if record:
            self.times.append(elapsed * 1e6)
        for h in self.histories:  # generation goes on: the penalised history grows by one token per step
            h.token_ids.append(token)

    def figures(self) -> dict | None:
        if not self.supported:
            return None
        times = sorted(self.times)
        return {"median_us": statistics.median(times), "p90_us": percentile(times, 0.9)}


def _time_batch(batch: int, vocab: int, warmup: int, steps: int, device: torch.device) -> dict[str, dict | None]:
    """Every mix of one batch size, interleaved step by step so that machine noise falls on all alike."""
    gen = torch.Generator().manual_seed(batch)
    mixes = {name: _Mix(rows, vocab, gen, device) for name, rows in _mixes(batch).items()}
    logits = [(torch.randn(batch, vocab, generator=gen) * 4).to(device) for _ in range(4)]
    for step in range(warmup + steps):
        x = logits[step % len(logits)]
        for mix in mixes.values():
            if mix.supported:
                mix.step(x, step >= warmup, step % vocab)
    return {name: mix.figures() for name, mix in mixes.items()}


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"sampler time per decode step on {args.device} (vocab {args.vocab}, {args.steps} steps after {args.warmup} "
          f"warm-up, {torch.get_num_threads()} threads): median us (p90)", flush=True)
    results: list[dict] = []
    names = list(_mixes(1))
    header = f"{'mix':<20}" + "".join(f"{'batch ' + str(b):>22}" for b in args.batch_sizes)
    by_batch = {}
    for batch in args.batch_sizes:
        print(f"timing batch {batch} ...", flush=True)
        by_batch[batch] = _time_batch(batch, args.vocab, args.warmup, args.steps, torch.device(args.device))
    print(header, flush=True)
    for name in names:
        cells = []
        for batch in args.batch_sizes:
            figures = by_batch[batch][name]
            results.append({"mix": name, "batch": batch, **(figures or {"unsupported": True})})
            cells.append("unsupported" if figures is None
                         else f"{figures['median_us']:.0f} ({figures['p90_us']:.0f})")
        print(f"{name:<20}" + "".join(f"{c:>22}" for c in cells), flush=True)
    base = {r["batch"]: r["median_us"] for r in results if r["mix"] == "greedy"}
    mixed = {r["batch"]: r.get("median_us") for r in results if r["mix"] == "greedy+1 top-p"}
    for batch in args.batch_sizes:
        if mixed.get(batch) is not None and base.get(batch):
            extra = mixed[batch] - base[batch]
            line = f"one top-p row in a greedy batch of {batch}: +{extra:.0f} us over the all-greedy sampler step"
            if args.decode_step_ms:
                line += f" = {100 * extra / (args.decode_step_ms * 1000):.2f}% of a {args.decode_step_ms:g} ms decode step"
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "vocab": args.vocab, "threads": torch.get_num_threads(), "results": results}, f, indent=2)
        print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
