"""The engine section of the GPU check: whole iterations (ModelRunner + sampler) of a random-weight model against
the roofline. Targets: decode at batch 64 within 1.3x of (weight + KV bytes) / bandwidth (the CUDA-graph path,
the one the engine serves decodes with); the mixed iteration at >= 55% of the matrix rate."""
from __future__ import annotations

import os
import time

from gpu_report import TARGETS
from gpu_timing import empty_cache, synchronize, wall_ms

DECODE_TARGET = f"<= {TARGETS['decode_b64_over_floor']}x floor"  # at --decode-target-batch (64)
MIXED_TARGET = f">= {TARGETS['mixed_matmul_fraction']:.2f} of matmul rate"


def engine_section(report, backends: dict, device, args) -> None:
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.models.loader import load_model

    t0 = time.monotonic()
    loaded = load_model(ModelConfig(model=args.model, device=str(device), dtype="bfloat16",
                                    max_model_len=args.max_model_len))
    synchronize(device)
    report.info(f"random-weight {args.model} loaded", f"{time.monotonic() - t0:.1f} s")
    serving = [n for n in ("triton", "flashinfer") if n in backends]
    if not serving:
        report.unmeasured(f"decode b={args.decode_target_batch} and mixed iterations", DECODE_TARGET,
                          "neither triton nor flashinfer ready")
    for name in serving:
        if report.left_s() < 45:
            report.unmeasured(f"{name} iterations", DECODE_TARGET, "time budget spent")
            continue
        _backend_iterations(report, name, loaded, device, args)
        empty_cache(device)


def _backend_iterations(report, name: str, loaded, device, args) -> None:
    import torch

    from stallfree.node_daemon.engine.config import CacheConfig
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.engine.cuda_graphs import DecodeCudaGraphs
    from stallfree.node_daemon.engine.model_executor import ModelExecutor
    from stallfree.node_daemon.engine.model_runner import ModelRunner

    from batches import decode_batch, engine_iteration, mixed_batch
    from roofline import decode_floor_s, iteration_flops

    shape = loaded.shape
    bw, rate = report.ceilings["copy_bandwidth_bytes_s"], report.ceilings["bf16_matmul_flop_s"]
    decodes = {b: decode_batch(b, args.engine_context) for b in args.decode_batches}
    mixed = mixed_batch(args.mixed_tokens, args.mixed_decodes, args.engine_context, args.chunk_prefix)
    blocks = max(sum(-(-s.seq_len // 16) for s in batch) for batch in [*decodes.values(), mixed]) + 16
    os.environ["STALLFREE_CUDA_GRAPHS"] = "0"  # capture below, at the buckets this check times only
    runner = ModelRunner(ModelConfig(model=args.model, device=str(device), dtype="bfloat16", attention_backend=name,
                                     max_model_len=args.max_model_len),
                         CacheConfig(block_size=16, num_blocks=blocks, enable_prefix_caching=False),
                         max_num_tokens=args.mixed_tokens, max_num_seqs=max(args.decode_batches), loaded=loaded)
    os.environ["STALLFREE_CUDA_GRAPHS"] = "1"
    for k_cache, v_cache in runner.kv_caches:  # random cached context, never zeros
        k_cache.normal_()
        v_cache.normal_()
    executor = ModelExecutor(runner)
    warmup = min(3, args.reps)
    graphs, no_graphs = None, "not on CUDA"
    if device.type == "cuda":
        try:
            graphs = DecodeCudaGraphs.for_runner(runner, batch_sizes=list(args.decode_batches))
            no_graphs = "" if graphs is not None else "graphs off or unsupported by the backend"
            report.correct(f"{name} decode graph capture", "captured" if graphs else no_graphs, graphs is not None,
                           "captures")
        except Exception as exc:
            no_graphs = f"{type(exc).__name__}: {exc}"
            report.correct(f"{name} decode graph capture", no_graphs, False, "captures")
    for b, batch in decodes.items():
        output, _ = engine_iteration(batch, 16, shape.vocab_size)
        floor = decode_floor_s(shape, batch, bw)
        timed = {}
        for mode in ("eager", "graph"):
            if mode == "graph" and graphs is None:
                continue
            runner.cuda_graphs = graphs if mode == "graph" else None
            timed[mode] = wall_ms(lambda: executor.execute(output), args.reps, device, warmup)
        serving_mode = "graph" if "graph" in timed else "eager"
        for mode, ms in timed.items():
            check = f"{name} decode b={b} ctx={args.engine_context} {mode}"
            figure = f"{ms:.2f} ms = {ms / 1e3 / floor:.2f}x floor ({floor * 1e3:.2f} ms)"
            if b == args.decode_target_batch and mode == serving_mode:
                note = "" if mode == "graph" else f" [eager: {no_graphs}]"
                report.target(check, figure + note, ms / 1e3 / floor <= TARGETS["decode_b64_over_floor"],
                              DECODE_TARGET, ms=ms, floor_ms=floor * 1e3)
            else:
                report.info(check, figure, ms=ms, floor_ms=floor * 1e3)
        if graphs is not None and b == args.decode_batches[min(1, len(args.decode_batches) - 1)]:
            runner.cuda_graphs = None
            eager_logits = runner.execute_model(output)
            runner.cuda_graphs = graphs
            graph_logits = runner.execute_model(output)
            err = ((graph_logits - eager_logits).norm() / eager_logits.norm()).item()
            report.correct(f"{name} graph vs eager logits b={b}", f"rel err {err:.1e}", err < TARGETS["bf16_rel_error"],
                           f"rel err < {TARGETS['bf16_rel_error']:.0e}", rel_error=err)
    if args.decode_target_batch not in decodes:
        report.unmeasured(f"{name} decode b={args.decode_target_batch}", DECODE_TARGET,
                          "--decode-target-batch not in --decode-batches")
    runner.cuda_graphs = None
    output, _ = engine_iteration(mixed, 16, shape.vocab_size)
    logits = runner.execute_model(output)
    report.correct(f"{name} mixed iteration logits", f"{tuple(logits.shape)}, finite: {bool(torch.isfinite(logits).all())}",
                   bool(torch.isfinite(logits).all()) and logits.shape[0] == len(mixed), "finite, one row per sequence")
    ms = wall_ms(lambda: executor.execute(output), args.reps, device, warmup)
    flops = iteration_flops(shape, mixed, sampled_rows=len(mixed))
    fraction = flops / (ms / 1e3) / rate
    report.target(f"{name} mixed {args.mixed_tokens} tok ({args.mixed_decodes} dec + chunk over {args.chunk_prefix})",
                  f"{ms:.2f} ms, {flops / (ms / 1e3) / 1e12:.1f} TFLOP/s = {fraction:.2f} of matmul",
                  fraction >= TARGETS["mixed_matmul_fraction"], MIXED_TARGET, ms=ms, matmul_fraction=fraction)
