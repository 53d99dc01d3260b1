"""`stallfree bench stall`: what one long prompt does to the streams already decoding, chunked vs unchunked.

N streams decode; then one long prompt arrives. Chunked (a small token budget) its prefill is cut into
budget-sized chunks that ride along with the decodes; unchunked (a budget of at least the prompt) it
runs in one iteration and every stream waits for it. For each mode this prints the streams' maximum and
p99 inter-token gap while the prompt is prefilled, and the prompt's TTFT. One model load serves both
modes, and a warm-up run comes first so one-time costs land in neither.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from stallfree.contracts import Ceilings, Tuning, min_budget_for, percentile

LONG_TEXT = (
    "Chunked prefill splits a long prompt into pieces that fit a fixed token budget per iteration, so "
    "the requests that are already decoding keep receiving one token every iteration instead of waiting "
    "for the whole prompt. The scheduler admits every running decode first, then the next chunk of any "
    "partially prefilled prompt, then new prompts in arrival order. Paris, Berlin, Madrid, Rome and Vienna "
    "are capitals; 1234567890 are digits. "
)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stallfree bench stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--streams", type=int, default=4, help="requests decoding when the long prompt arrives")
    p.add_argument("--prompt-len", type=int, default=1500, help="tokens of the long prompt")
    p.add_argument("--chunked-budget", type=int, default=128, help="token budget of the chunked run")
    p.add_argument("--unchunked-budget", type=int, default=0,
                   help="token budget of the unchunked run (0: prompt length + streams, so it runs in one go)")
    p.add_argument("--warm-tokens", type=int, default=3, help="tokens each stream decodes before the prompt arrives")
    p.add_argument("--after-tokens", type=int, default=2, help="iterations kept after the prompt's first token")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on the CPU (0: torch's default). One thread keeps iteration times "
                        "steady on a shared machine, where spinning OpenMP workers slow every matmul many times over")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--output", default=None, help="JSON file (default runs/bench_stall-<time>.json)")
    return p.parse_args(argv)


def _long_prompt(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(LONG_TEXT)
    return ids[:n]


def run_mode(executor, tokenizer, args: argparse.Namespace, budget: int, max_num_seqs: int,
             ceilings: Ceilings, long_prompt: list[int]) -> dict:
    from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.engine.engine import LLMEngine
    from stallfree.node_daemon.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=ModelConfig(model=args.model, device=args.device, dtype=args.dtype),
        cache=CacheConfig(enable_prefix_caching=False),  # every run prefills the long prompt for real
        scheduler=SchedulerConfig(ceilings=ceilings, tuning=Tuning(token_budget=budget, max_num_seqs=max_num_seqs)),
    )
    engine = LLMEngine(config, executor=executor, tokenizer=tokenizer)
    # Enough tokens to outlast the prefill at any budget, small enough that every stream is admitted at once.
    decode = SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True)
    streams = [f"stream-{i}" for i in range(args.streams)]
    for i, rid in enumerate(streams):
        engine.add_request(rid, prompt=f"Stream {i}: tell me a long story about the number {i}.", sampling=decode)
    token_times: dict[str, list[float]] = {rid: [] for rid in streams}

    def step() -> list:
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            if out.request_id in token_times and out.new_token_ids:
                token_times[out.request_id].append(now)
        return outputs

    while min(len(t) for t in token_times.values()) < args.warm_tokens:
        step()
    decode_only = []
    for _ in range(2):  # the streams' steady decode iteration, for reference
        t0 = time.monotonic()
        step()
        decode_only.append(time.monotonic() - t0)

    arrival = time.monotonic()
    engine.add_request("long-prompt", prompt_token_ids=long_prompt,
                       sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), arrival_time=arrival)
    first_token = None
    iterations_to_first_token = 0
    after = 0
    while after < args.after_tokens:
        outputs = step()
        if first_token is None:
            iterations_to_first_token += 1
            if any(o.request_id == "long-prompt" and o.new_token_ids for o in outputs):
                first_token = time.monotonic()
        else:
            after += 1
    engine.abort_all()

    gaps_ms: list[float] = []
    during = 0
    for times in token_times.values():
        for prev, cur in zip(times, times[1:]):
            if cur > arrival:  # gaps that end after the prompt arrived
                gaps_ms.append((cur - prev) * 1000)
            if arrival < cur <= first_token:  # type: ignore[operator]
                during += 1
    return {
        "token_budget": budget,
        "max_gap_ms": round(max(gaps_ms), 2),
        "p99_gap_ms": round(percentile(sorted(gaps_ms), 0.99), 2),
        "ttft_ms": round((first_token - arrival) * 1000, 2),  # type: ignore[operator]
        "iterations_to_first_token": iterations_to_first_token,
        "decode_tokens_during_prefill": during,
        "decode_iteration_ms": round(min(decode_only) * 1000, 2),
        "num_gaps": len(gaps_ms),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.streams < 1 or args.prompt_len < 2 or args.chunked_budget < 1:
        print("stallfree bench stall: error: --streams, --prompt-len and --chunked-budget must be positive", file=sys.stderr)
        return 2
    max_num_seqs = args.streams + 1
    unchunked = args.unchunked_budget or args.prompt_len + args.streams
    if unchunked < args.prompt_len + args.streams:
        print(f"stallfree bench stall: error: --unchunked-budget must hold the prompt and the decodes "
              f"({args.prompt_len + args.streams})", file=sys.stderr)
        return 2
    chunked = max(args.chunked_budget, min_budget_for(max_num_seqs))
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    ceilings = Ceilings(max_token_budget=unchunked, max_num_seqs=max_num_seqs)

    from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.engine.model_executor import ModelExecutor
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    try:
        executor = ModelExecutor.from_config(EngineConfig(
            model=ModelConfig(model=args.model, device=args.device, dtype=args.dtype,
                              attention_backend=args.attention_backend),
            cache=CacheConfig(),
            scheduler=SchedulerConfig(ceilings=ceilings, tuning=Tuning(token_budget=chunked, max_num_seqs=max_num_seqs)),
        ))
    except ValueError as exc:
        print(f"stallfree bench stall: error: {exc}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(executor.loaded)
    if args.prompt_len + 8 >= executor.max_model_len:
        print(f"stallfree bench stall: error: --prompt-len must stay below the context ({executor.max_model_len})",
              file=sys.stderr)
        return 2
    long_prompt = _long_prompt(tokenizer, args.prompt_len)

    # Warm-up: one chunked and one unchunked pass over a shorter prompt, not measured.
    warm = argparse.Namespace(**{**vars(args), "warm_tokens": 1, "after_tokens": 1})
    run_mode(executor, tokenizer, warm, chunked, max_num_seqs, ceilings, long_prompt[:max(2, args.prompt_len // 4)])
    run_mode(executor, tokenizer, warm, unchunked, max_num_seqs, ceilings, long_prompt[:max(2, args.prompt_len // 4)])

    results = {
        "chunked": run_mode(executor, tokenizer, args, chunked, max_num_seqs, ceilings, long_prompt),
        "unchunked": run_mode(executor, tokenizer, args, unchunked, max_num_seqs, ceilings, long_prompt),
    }
    c, u = results["chunked"], results["unchunked"]
    summary = {
        "max_gap_reduction": round(u["max_gap_ms"] / c["max_gap_ms"], 2),
        "ttft_increase": round(c["ttft_ms"] / u["ttft_ms"] - 1.0, 4),
    }
    report = {**results, **summary, "model": args.model, "device": str(executor.runner.device),
              "streams": args.streams, "prompt_len": args.prompt_len, "torch_threads": _torch_threads()}
    path = Path(args.output) if args.output else Path("runs") / f"bench_stall-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.model} on {report['device']}: {args.streams} streams decoding, a {args.prompt_len}-token prompt arrives")
        for name, r in results.items():
            print(f"  {name:<9} budget {r['token_budget']:>5}: max gap {r['max_gap_ms']:9.1f} ms  "
                  f"p99 gap {r['p99_gap_ms']:9.1f} ms  TTFT {r['ttft_ms']:9.1f} ms  "
                  f"({r['iterations_to_first_token']} iterations, {r['decode_tokens_during_prefill']} decode tokens meanwhile)")
        print(f"  max gap {summary['max_gap_reduction']}x smaller chunked; TTFT {summary['ttft_increase'] * 100:+.1f}% "
              f"chunked vs unchunked")
        print(f"  wrote {path}")
    return 0


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    sys.exit(main())
