"""`stallfree bench <name>`: each benchmark is a module with main(argv); they print figures and write JSON/PNG."""
from __future__ import annotations

import sys

from stallfree.cli import run_module_main

BENCHMARKS: dict[str, tuple[str, str]] = {
    "scheduler": ("stallfree.bench.scheduler", "microseconds per scheduling step (256 running, 1024 waiting)"),
    "stall": ("stallfree.bench.stall", "decode gaps when a long prompt arrives: chunked vs unchunked"),
    "itl": ("stallfree.bench.itl", "client-seen vs engine-side inter-token latency (API overhead)"),
    "serve": ("stallfree.bench.serve", "load against any OpenAI-compatible endpoint"),
    "sampler": ("stallfree.bench.sampler", "sampler time per decode step: batches 1/16/64, greedy, top-p, penalties"),
    "router": ("stallfree.bench.router", "routing policies through `stallfree router` on 4 sim daemons; --objectives"),
    "engine": ("stallfree.bench.engine", "every row of the engine-speed table against a real daemon (JSON)"),
    "iteration": ("stallfree.bench.iteration", "host (input prep + sampling) vs forward time per decode iteration"),
    "matmul": ("stallfree.bench.matmul", "a quantized model's projections through the code, int4 and oneDNN kernels"),
    "soak": ("stallfree.bench.soak", "thousands of requests, cancellations and a kill across local replicas"),
    "kv-estimate": ("stallfree.bench.kv_estimate", "chats without max_tokens run together; a 2-token request behind them"),
    "write-gguf": ("stallfree.bench.write_random_gguf", "a random-weight GGUF of Llama-3.2-1B's shape (q4_0, q4_k_m)"),
    "hostile": ("stallfree.bench.hostile", "streams' gaps and /health while 1.33M token ids or 100k messages arrive"),
    "agree": ("stallfree.bench.agree", "greedy tokens and top-5 logprobs against llama.cpp's llama-server on GGUFs"),
    "agree-rate": ("stallfree.bench.agree_rate", "greedy agreement with the float32 reference on 120 prompts: "
                   "the serving path beside llama.cpp"),
    "speculation": ("stallfree.bench.speculation", "output tok/s and draft acceptance, echo and open workloads, "
                    "against any OpenAI-compatible server"),
}


def _usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: stallfree bench <name> [options]", "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    return run_module_main(BENCHMARKS, argv[0], argv[1:], _usage())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
