#!/usr/bin/env python3
"""The prepared GPU check: one call on one H100/H200 (torch 2.11, triton 3.6, no network), inside its budget.

Sections, in this order, each bounded by the time budget and reported even if another fails:
  backends     torch, triton, flashinfer instantiated and probed (a missing one is skipped, with the reason)
  correctness  every backend in bf16 against the float64 reference: decodes, prefills, chunks over a prefix,
               mixed; GQA 4 (Llama-3) and 3 (SmolLM2); pages of 16 and 32; outputs poisoned with NaN; KV write exact
  ceilings     device-to-device copy bandwidth (bytes read + written) and the bf16 8192^3 matrix rate
  engine       whole iterations (ModelRunner + sampler) of a random-weight Llama-3-8B: decode at batch
               1/32/64/128 (eager and CUDA graph) against the HBM roofline, a mixed 2,048-token iteration
               against the matrix rate
  attention    one layer's attention, Triton against flashinfer, by CUDA-graph replay past the L2; a launch sweep
  fused_ops    flashinfer's RMSNorm, add+RMSNorm, SiLU-and-mul, RoPE and sampling against the torch paths
Targets: decode step at batch 64 within 1.3x of (weight + KV bytes) / bandwidth; the 2,048-token
iteration at >= 55% of the measured matrix rate; Triton attention within 1.5x of flashinfer.

It prints one table (row, figure, target, verdict), writes the JSON, and exits 0 only when every correctness row
passed, every target was met against ceilings measured in this run, and every section ran (gpu_report.py).

    python3 e2e/gpu/gpu_check.py                 # on the GPU; JSON to $OUT/gpu_check.json when OUT is set
    python3 e2e/gpu/gpu_check.py --dry-run       # any machine: the same sections on the CPU at small sizes
The dry run runs every section through the real code (Triton under its interpreter, host-clock timers, no CUDA
graphs) plus a plan section that builds the GPU run's own batches; its targets are shown, not judged.
flashinfer is optional: without it (or without its compiled kernels, see e2e/gpu/README.md) its rows are
skipped with the reason and the Triton/flashinfer targets are unmeasured. FLASHINFER_DISABLE_JIT=1 is set
unless --flashinfer-jit: a JIT build of its attention kernels takes minutes and would eat the budget.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from gpu_report import Report  # noqa: E402

SECTIONS = ("correctness", "ceilings", "engine", "attention", "fused_ops")


def bootstrap_package() -> None:
    """Make `stallfree` importable from this checkout without installing it (the GPU machine has no network)."""
    try:
        import stallfree.kernels.attention  # noqa: F401
        return
    except ImportError:
        pass
    root = types.ModuleType("stallfree")
    root.__path__ = [os.path.join(REPO, "common")]  # a namespace package, as pyproject.toml's package-dir maps it
    sys.modules["stallfree"] = root
    for sub in ("node_daemon", "kernels"):
        folder = os.path.join(REPO, sub)
        spec = importlib.util.spec_from_file_location(f"stallfree.{sub}", os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        setattr(root, sub, module)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from scale import DRY_RUN_ARGS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="no GPU: every section on the CPU at small sizes")
    p.add_argument("--json", default=None, help="where to write the JSON (default $OUT/gpu_check.json when OUT is set)")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections after this many seconds")
    p.add_argument("--model", default="llama-3-8b", help="model shape for the engine section (random weights)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 64, 128])
    p.add_argument("--decode-target-batch", type=int, default=64, help="the decode batch the roofline target judges")
    p.add_argument("--engine-context", type=int, default=1024, help="cached tokens per decoding sequence")
    p.add_argument("--attn-context", type=int, default=2048, help="cached tokens per decode in the attention section")
    p.add_argument("--mixed-tokens", type=int, default=2048)
    p.add_argument("--mixed-decodes", type=int, default=32)
    p.add_argument("--chunk-prefix", type=int, default=1024, help="cached prefix under the mixed iteration's chunk")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--backends", default="torch,triton,flashinfer")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the Triton launch-shape sweep")
    p.add_argument("--flashinfer-jit", action="store_true", help="let flashinfer JIT-compile missing kernels (minutes)")
    p.add_argument("--seed", type=int, default=None, help="default: fresh each run (printed)")
    gpu_defaults = p.parse_args([])
    if argv is not None and "--dry-run" in argv or argv is None and "--dry-run" in sys.argv[1:]:
        p.set_defaults(**DRY_RUN_ARGS)
    args = p.parse_args(argv)
    problems = []
    if any(b < 1 for b in args.decode_batches):
        problems.append("--decode-batches must be positive")
    if args.mixed_decodes >= args.mixed_tokens:
        problems.append("--mixed-decodes must leave room for a prefill chunk in --mixed-tokens")
    longest = max(args.engine_context, args.chunk_prefix + args.mixed_tokens - args.mixed_decodes)
    if longest > args.max_model_len:
        problems.append(f"the longest sequence ({longest} tokens) exceeds --max-model-len {args.max_model_len}")
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        problems.append(f"unknown sections {sorted(unknown)}")
    if problems:
        p.error("; ".join(problems))
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little") >> 1
    gpu_defaults.seed = args.seed
    args.gpu_defaults = gpu_defaults
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "gpu_check.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.flashinfer_jit:
        os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated: Triton runs on the CPU
    bootstrap_package()
    import torch

    from scale import DRY_RUN, GPU

    report = Report(args.budget_s, dry_run=args.dry_run)
    report.data["args"] = {k: v for k, v in vars(args).items() if k != "gpu_defaults"}
    print(f"seed {args.seed}")
    if args.dry_run:
        device, scale = torch.device("cpu"), DRY_RUN
        torch.set_num_threads(1)  # shared cores: one steady thread beats spinning ones
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a machine without a GPU", file=sys.stderr)
        return 2
    else:
        device, scale = torch.device("cuda", 0), GPU
    report.data["environment"] = environment(device)
    print(report.data["environment"], flush=True)
    sections = args.sections.split(",")
    asked = ["backends", *sections] + (["plan"] if args.dry_run else [])
    from gpu_engine_checks import engine_section
    from gpu_fused_checks import fused_ops_section
    from gpu_kernel_checks import attention_section, backends_section, ceilings_section, correctness_section

    backends: dict = {}
    report.run("backends", 5, lambda: backends.update(backends_section(report, device, args.backends.split(","), scale)))
    if args.dry_run:
        from gpu_plan import plan_section

        report.run("plan", 5, lambda: plan_section(report, args.gpu_defaults))
    runs = {
        "correctness": (40, lambda: correctness_section(report, backends, device, scale, args.seed)),
        "ceilings": (20, lambda: ceilings_section(report, device, scale)),
        "engine": (60, lambda: engine_section(report, backends, device, args)),
        "attention": (60, lambda: attention_section(report, backends, device, scale, args)),
        "fused_ops": (15, lambda: fused_ops_section(report, device, scale, 1 if args.dry_run else 2)),
    }
    for name in SECTIONS:  # the fixed order: correctness first, ceilings before any target
        if name in sections:
            report.run(name, *runs[name])
    return report.finish(asked, args.json)


def environment(device) -> dict:
    import torch
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(name=props.name, sms=props.multi_processor_count, memory_gb=round(props.total_memory / 1e9, 1),
                   capability=list(torch.cuda.get_device_capability(device)))
    from stallfree.kernels.flashinfer_backend import import_flashinfer  # the engine's import (CUDA RMSNorm)

    try:
        env["flashinfer"] = getattr(import_flashinfer(), "__version__", "?")
    except ImportError as exc:
        env["flashinfer"] = f"absent ({exc.__cause__ or exc})"
    return env


if __name__ == "__main__":
    sys.exit(main())
