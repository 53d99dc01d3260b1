"""`stallfree serve`: the per-node serving daemon (OpenAI API, /metrics, admin API, drain on SIGTERM).

This module parses the flags into the daemon's checked configuration (node_daemon/serve_config.py); the start-up
itself (model, profile, starting budget, engine loop, HTTP server) is node_daemon/daemon.py. A bad flag exits with
status 2, a start-up failure with status 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from stallfree.contracts import min_budget_for
from stallfree.http_doors.flags import add_door_flags
from stallfree.node_daemon.daemon import CPU_TOKEN_BUDGET
from stallfree.node_daemon.serve_config import ServeConfig

# The budget a daemon starts with when told neither a budget nor a TPOT SLO.
DEFAULT_TOKEN_BUDGET = 512


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree serve", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model and device")
    m.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (embedded GGUF), a shape name (random weights), a HF folder or a .gguf file")
    m.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    m.add_argument("--backend", choices=["model", "sim"], default="model",
                   help="model: run the model; sim: the cost model's time passes instead (same scheduler and API)")
    m.add_argument("--hardware", default="h100", help="sim backend: hardware preset (a100, h100, h200, ...)")
    m.add_argument("--tflops", type=float, default=None, help="sim backend: achieved matrix TFLOP/s (overrides the preset)")
    m.add_argument("--hbm-tbps", type=float, default=None, help="sim backend: achieved HBM TB/s (overrides the preset)")
    m.add_argument("--overhead-ms", type=float, default=None, help="sim backend: fixed cost of every iteration (ms)")
    m.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when present")
    m.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: the checkpoint's, or what the device runs best")
    m.add_argument("--attention-backend", choices=["auto", "cpu", "torch", "triton", "flashinfer"], default="auto",
                   help="attention kernels (auto: the best the device has)")
    m.add_argument("--cpu-dense-copy", choices=["auto", "on", "off"], default="auto",
                   help="AVX-512 CPUs: oneDNN bfloat16 copies of a GGUF model's projections for prefill chunks "
                        "(2 bytes a parameter beside the codes; auto: while they take at most 1 GiB, and never "
                        "on AVX512-VNNI without AMX, where the code kernel's int8 products are faster). Without "
                        "them prefill chunks dequantize a projection at a time for the same GEMM: 1.1-1.4x slower "
                        "at 512-token chunks, 1.5-2x at the 64-token budgets a tight TPOT SLO holds")
    m.add_argument("--threads", type=int, default=0,
                   help="torch threads on the CPU (0: the cores this process is given: affinity, cgroup quota)")
    m.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    m.add_argument("--seed", type=int, default=0, help="random weights and unseeded sampling")
    m.add_argument("--tool-call-parser", default=None,
                   help="how the model writes tool calls: hermes (also qwen), llama3_json, mistral "
                        "(default: detected from the chat template, else hermes)")

    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    c.add_argument("--num-kv-blocks", type=int, default=0, help="0: size from --kv-memory-fraction")
    c.add_argument("--kv-memory-fraction", type=float, default=0.9,
                   help="share of free device memory for the KV cache")
    c.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")

    s = p.add_argument_group("scheduling (ceilings fixed at start; live knobs move below them)")
    s.add_argument("--max-token-budget", type=int, default=2048, help="ceiling of the token budget")
    s.add_argument("--max-num-seqs-ceiling", type=int, default=256, help="ceiling of max_num_seqs")
    s.add_argument("--token-budget", default="auto",
                   help="tokens per iteration, or auto: from the profile and --tpot-slo-ms "
                        f"(else {CPU_TOKEN_BUDGET} on the CPU, {DEFAULT_TOKEN_BUDGET} elsewhere)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="live cap on running requests")
    s.add_argument("--max-partial-prefills", type=int, default=1, help="live cap on concurrent partial prefills")
    s.add_argument("--long-prefill-threshold", type=int, default=0, help="0: no per-request prefill cap")
    s.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="TPOT target: picks the starting budget")
    s.add_argument("--speculative", choices=["off", "ngram"], default="off",
                   help="ngram: each decode proposes the tokens that followed the latest earlier occurrence of its "
                        "last tokens (prompt lookup) and verifies them in the same iteration, inside the token budget; "
                        "a request whose drafts are not accepted stops drafting (greedy outputs are unchanged, sampled "
                        "ones keep their distribution)")
    s.add_argument("--speculative-max-draft", type=int, default=8, help="draft tokens per decode at most")
    s.add_argument("--speculative-max-rows", type=int, default=0,
                   help="drafts only while an iteration's decodes and draft tokens stay within this many rows (0: "
                        "where the device's projections stay bound by reading the weights: 8 on the CPU, 64 on a GPU)")
    s.add_argument("--no-profile", action="store_true", help="skip the start-up profile (needs --token-budget N)")
    s.add_argument("--no-prefix-cut", action="store_true",
                   help="keep prefill chunks over a long cached prefix at the full budget (by default they are cut "
                        "to the budget's iteration time, from what served iterations show the prefix costs)")
    s.add_argument("--profile-max-seconds", type=float, default=5.0,
                   help="time budget of the start-up profile (fewer points past it)")
    s.add_argument("--profile-cache-dir", default=None,
                   help="where measured profiles are kept (else $STALLFREE_PROFILE_CACHE, else "
                        "$XDG_CACHE_HOME/stallfree/profiles)")
    s.add_argument("--no-profile-cache", action="store_true", help="always measure; never read or write the cache")

    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1",
                   help="address to bind; loopback unless told (containers pass 0.0.0.0)")
    h.add_argument("--port", type=int, default=8000, help="HTTP port")
    # Off by default: local runs and tests take free ports one at a time; the operator's pods pass it.
    h.add_argument("--probe-port", type=int, default=0,
                   help="port of /health and /ready alone, with no connection cap, for kubelet probes (a flood on "
                        "the serving port cannot fail liveness); 0: none (/health stays on --port too)")
    h.add_argument("--admin-token-file", default=None, help="file holding the admin bearer token "
                   "(else env STALLFREE_ADMIN_TOKEN; without one the admin API is closed)")
    h.add_argument("--api-key-file", default=None, help="file holding the API key (else env STALLFREE_API_KEY; "
                   "without one the inference API is open)")
    h.add_argument("--max-queue-requests", type=int, default=1024, help="queued requests before 429 (0: no bound)")
    h.add_argument("--max-queue-tokens", type=int, default=0, help="queued prompt tokens before 429 (0: no bound)")
    add_door_flags(h)
    h.add_argument("--text-workers", type=int, default=2,
                   help="threads that template and tokenize large prompts off the event loop")
    h.add_argument("--drain-timeout-s", type=float, default=30.0, help="grace period for in-flight requests")
    h.add_argument("--stats-window-s", type=float, default=30.0, help="sliding window of /admin/stats")
    h.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    return p


def parse_options(argv: list[str]) -> ServeConfig:
    """Parse the command line into the daemon's checked configuration; ValueError names the bad flag."""
    return config_from_args(build_parser().parse_args(argv))


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The one place the flags become the daemon's configuration (nothing past it reads the namespace)."""
    from stallfree.node_daemon.server.auth import ADMIN_TOKEN_ENV, API_KEY_ENV, watched_secret

    values = vars(args).copy()
    admin_token_file, api_key_file = values.pop("admin_token_file"), values.pop("api_key_file")
    auto_budget = values["token_budget"] == "auto"
    if auto_budget:
        max_num_seqs = max(1, min(args.max_num_seqs, args.max_num_seqs_ceiling))
        budget = min(args.max_token_budget, max(DEFAULT_TOKEN_BUDGET, min_budget_for(max_num_seqs)))
    else:
        try:
            budget = int(values["token_budget"])
        except ValueError:
            raise ValueError(f"--token-budget must be an integer or auto, got {args.token_budget!r}") from None
    values.update(token_budget=budget, auto_budget=auto_budget,
                  served_model_name=args.served_model_name or args.model)
    config = ServeConfig(**values)  # checked here: ValueError naming the flag
    # Secrets last: a bad flag is reported without touching their files.
    return dataclasses.replace(config, admin_token=watched_secret(admin_token_file, ADMIN_TOKEN_ENV),
                               api_key=watched_secret(api_key_file, API_KEY_ENV))


def main(argv: list[str]) -> int:
    try:
        opts = parse_options(argv)
    except ValueError as exc:
        print(f"stallfree serve: error: {exc}", file=sys.stderr)
        return 2
    from stallfree.node_daemon.daemon import run

    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failure = run(opts)
    if failure is not None:
        print(f"stallfree serve: error: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
