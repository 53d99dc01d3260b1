"""`stallfree generate`: run one prompt (plain or --chat) through the engine and print the text as it streams.

Bad input (empty or over-long prompt, max_tokens < 1, unknown model) prints one line naming the
problem and exits 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys
import time

from stallfree.contracts import Ceilings, Tuning, min_budget_for


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallfree generate", description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="the prompt text (a user message with --chat)")
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m (embedded), a shape name (random weights), a HF folder or a .gguf file")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    parser.add_argument("--system", default=None, help="a system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--token-budget", type=int, default=256, help="tokens per iteration (prefill chunk size)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads on the CPU (0: the cores this process is given: affinity, cgroup quota)")
    parser.add_argument("--stats", action="store_true", help="print TTFT, TPOT and token counts to stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"stallfree generate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    from stallfree.node_daemon.engine.sampling_params import SamplingParams

    # Check what needs no model first, so bad input fails fast.
    if not args.prompt:
        raise ValueError("the prompt is empty")
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos)
    sampling.check()
    if args.token_budget < 1:
        raise ValueError(f"--token-budget must be positive, got {args.token_budget}")

    from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.engine.engine import LLMEngine

    max_num_seqs = 1
    budget = max(args.token_budget, min_budget_for(max_num_seqs))
    config = EngineConfig(
        model=ModelConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                          threads=args.threads),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(ceilings=Ceilings(max_token_budget=budget, max_num_seqs=max_num_seqs),
                                  tuning=Tuning(token_budget=budget, max_num_seqs=max_num_seqs)),
    )
    engine = LLMEngine(config)
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    engine.add_request("generate-0", prompt=prompt, sampling=sampling)
    finish_reason = None
    num_output = num_prompt = 0
    start = time.monotonic()
    first_token_at = None
    while engine.has_unfinished():
        for output in engine.step():
            if first_token_at is None and output.new_token_ids:
                first_token_at = time.monotonic()
            sys.stdout.write(output.text)
            sys.stdout.flush()
            if output.finished:
                finish_reason = output.finish_reason
                num_output, num_prompt = output.num_output_tokens, output.num_prompt_tokens
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        end = time.monotonic()
        ttft = (first_token_at or end) - start
        tpot = (end - (first_token_at or end)) / max(1, num_output - 1)
        print(f"prompt_tokens={num_prompt} output_tokens={num_output} finish_reason={finish_reason} "
              f"ttft_ms={ttft * 1000:.1f} tpot_ms={tpot * 1000:.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
