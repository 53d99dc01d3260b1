"""`stallfree profile`: iteration time against tokens per iteration on this device, as a daemon measures it.

The same engine build and the same sweep as `stallfree serve`'s start-up profile (node_daemon/measure/profiler.py),
with a larger time budget: prints both curves, the budget Sarathi-Serve's recipe picks for each TPOT target, and
writes JSON (the /admin/profile shape) and optionally a PNG. --write-cache stores a trusted run in the profile
cache, where `stallfree serve` started with the same flags finds it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_TARGETS_MS = (10.0, 20.0, 30.0, 50.0, 100.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree profile", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--backend", choices=["model", "sim"], default="model")
    p.add_argument("--hardware", default="h100", help="sim backend: hardware preset")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--attention-backend", choices=["auto", "cpu", "torch", "triton", "flashinfer"], default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=0)
    p.add_argument("--kv-memory-fraction", type=float, default=0.9)
    p.add_argument("--max-token-budget", type=int, default=2048, help="largest mixed point (the budget ceiling)")
    p.add_argument("--max-num-seqs-ceiling", type=int, default=256, help="largest decode-only batch")
    p.add_argument("--repeats", type=int, default=3, help="measured iterations per point (the fastest kept)")
    p.add_argument("--decode-context", type=int, default=32, help="prompt tokens of each decoding request")
    p.add_argument("--mixed-decodes", type=int, default=4, help="decodes beside the prefill on the mixed curve")
    p.add_argument("--max-seconds", type=float, default=60.0, help="time budget (points past it are skipped)")
    p.add_argument("--write-cache", action="store_true", help="store a trusted profile in the profile cache")
    p.add_argument("--profile-cache-dir", default=None, help="the cache folder (default: as stallfree serve)")
    p.add_argument("--tpot-slo-ms", type=float, action="append", default=None,
                   help="TPOT target(s) to suggest a budget for (repeatable)")
    p.add_argument("--json", default="runs/profile.json", help="where to write the profile")
    p.add_argument("--png", default=None, help="also plot both curves here")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.max_seconds <= 0:
        print("stallfree profile: error: --repeats and --max-seconds must be positive", file=sys.stderr)
        return 2
    from stallfree.node_daemon.measure.profile_cache import ProfileCache, profile_key
    from stallfree.node_daemon.measure.profiler import ProfileSettings, run_profile, suggest_token_budget
    from stallfree.profile_rules import SLO_MARGIN
    from stallfree.cli.serve import parse_options
    from stallfree.node_daemon.daemon import build_llm_engine

    serve_argv = [
        "--model", args.model, "--backend", args.backend, "--hardware", args.hardware, "--device", args.device,
        "--dtype", args.dtype, "--attention-backend", args.attention_backend, "--block-size", str(args.block_size),
        "--num-kv-blocks", str(args.num_kv_blocks), "--kv-memory-fraction", str(args.kv_memory_fraction),
        "--max-token-budget", str(args.max_token_budget), "--max-num-seqs-ceiling", str(args.max_num_seqs_ceiling),
        "--max-num-seqs", str(min(64, args.max_num_seqs_ceiling)),
    ]
    if args.max_model_len is not None:
        serve_argv += ["--max-model-len", str(args.max_model_len)]
    try:
        opts = parse_options(serve_argv)
        engine, device = build_llm_engine(opts, None)
    except (ValueError, FileNotFoundError) as exc:
        print(f"stallfree profile: error: {exc}", file=sys.stderr)
        return 2
    settings = ProfileSettings(repeats=args.repeats, decode_context=args.decode_context,
                               mixed_decodes=args.mixed_decodes, max_seconds=args.max_seconds, progress=print)
    started = time.monotonic()
    run = run_profile(engine, device, settings)
    profile = run.profile
    took = time.monotonic() - started
    for warning in run.warnings:
        print(f"warning: {warning}")

    print(f"profile of {args.model} on {device} ({took:.1f}s)")
    print("decode-only: batch  iteration ms")
    for p in profile.decode_only:
        print(f"  {p.tokens:>16}  {p.iteration_ms:10.3f}")
    print(f"mixed ({settings.mixed_decodes} decodes + one prefill chunk): tokens  iteration ms")
    for p in profile.mixed:
        print(f"  {p.tokens:>16}  {p.iteration_ms:10.3f}")
    targets = args.tpot_slo_ms or list(DEFAULT_TARGETS_MS)
    suggestions = {}
    if profile.mixed:
        print(f"TPOT target ms -> token budget (the daemon's start: largest whose iteration fits {SLO_MARGIN:.0%} "
              "of the target)")
        for target in targets:
            budget = suggest_token_budget(profile, target, engine.ceilings, engine.get_tuning())
            suggestions[str(target)] = budget
            fits = profile.iteration_ms_at(budget) <= SLO_MARGIN * target
            print(f"  {target:>14g} -> {budget}{'' if fits else '  (nothing measured fits: the smallest point)'}")

    out = profile.to_dict()
    out["suggested_token_budget_by_tpot_ms"] = suggestions
    out["model"] = args.model
    out["seconds"] = took
    out["warnings"] = run.warnings
    out["skipped"] = run.skipped
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    if args.write_cache:
        if run.trusted:
            print(f"cached at {ProfileCache(args.profile_cache_dir).store(profile_key(engine, device, settings), profile)}")
        else:
            print("not cached: the run is not trusted (see the warnings); measure again on a quiet machine")
    if args.png:
        _plot(profile, args.png, args.model)
        print(f"wrote {args.png}")
    return 0


def _plot(profile, path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if profile.decode_only:
        ax.plot([p.tokens for p in profile.decode_only], [p.iteration_ms for p in profile.decode_only], "o-",
                label="decode-only (batch size)")
    if profile.mixed:
        ax.plot([p.tokens for p in profile.mixed], [p.iteration_ms for p in profile.mixed], "s-",
                label=f"mixed ({profile.mixed[0].num_decodes} decodes + prefill chunk)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per iteration")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title(f"{model} on {profile.device}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
