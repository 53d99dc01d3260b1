"""The engine-level sections of the GPU check: whole iterations against the roofline, and the CPU dry run."""
from __future__ import annotations

import os
import time

from gpu_report import NOMINAL_H200, TARGETS, Report, table
from gpu_timing import wall_ms


def engine_timing(backends: dict, device, ceilings: dict, args, report, rows: list[dict]) -> None:
    import torch

    from stallfree.node_daemon.engine.config import CacheConfig
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.engine.cuda_graphs import DecodeCudaGraphs
    from stallfree.node_daemon.engine.model_executor import ModelExecutor
    from stallfree.node_daemon.engine.model_runner import ModelRunner
    from stallfree.node_daemon.models.loader import load_model

    from batches import decode_batch, engine_iteration, mixed_batch
    from roofline import decode_floor_s, iteration_flops

    bw, rate = ceilings["copy_bandwidth_bytes_s"], ceilings["bf16_matmul_flop_s"]
    model_config = ModelConfig(model=args.model, device=str(device), dtype="bfloat16", max_model_len=args.max_model_len)
    t0 = time.monotonic()
    loaded = load_model(model_config)
    torch.cuda.synchronize()
    print(f"random-weight {args.model} loaded in {time.monotonic() - t0:.1f} s", flush=True)
    shape = loaded.shape
    decodes = {b: decode_batch(b, args.engine_context) for b in args.decode_batches}
    mixed = mixed_batch(args.mixed_tokens, args.mixed_decodes, args.engine_context, args.chunk_prefix)
    blocks_needed = max(sum(-(-s.seq_len // 16) for s in batch) for batch in [*decodes.values(), mixed]) + 16
    for name in [n for n in ("triton", "flashinfer") if n in backends]:
        if report.left_s() < 45:
            rows.append({"iteration": f"{name}: remaining iterations", "error": "time budget"})
            break
        os.environ["STALLFREE_CUDA_GRAPHS"] = "0"  # capture below, at the buckets this check times only
        runner = ModelRunner(ModelConfig(model=args.model, device=str(device), dtype="bfloat16",
                                         attention_backend=name, max_model_len=args.max_model_len),
                             CacheConfig(block_size=16, num_blocks=blocks_needed, enable_prefix_caching=False),
                             max_num_tokens=args.mixed_tokens, max_num_seqs=max(args.decode_batches), loaded=loaded)
        os.environ["STALLFREE_CUDA_GRAPHS"] = "1"
        for k_cache, v_cache in runner.kv_caches:  # random cached context, never zeros
            k_cache.normal_()
            v_cache.normal_()
        executor = ModelExecutor(runner)
        t0 = time.monotonic()
        graphs = None
        try:
            graphs = DecodeCudaGraphs.for_runner(runner, batch_sizes=list(args.decode_batches))
            print(f"{name}: captured decode graphs {args.decode_batches} in {time.monotonic() - t0:.1f} s", flush=True)
        except Exception as exc:
            rows.append({"iteration": f"{name} graph capture", "error": f"{type(exc).__name__}: {exc}"})
        for b, batch in decodes.items():
            output, _ = engine_iteration(batch, 16, shape.vocab_size)
            floor = decode_floor_s(shape, batch, bw)
            for mode in ("eager", "graph"):
                if mode == "graph" and graphs is None:
                    continue
                runner.cuda_graphs = graphs if mode == "graph" else None
                ms = wall_ms(lambda: executor.execute(output), args.reps)
                rows.append({"iteration": f"{name} decode b={b} ctx={args.engine_context} {mode}", "ms": ms,
                             "floor_ms": floor * 1e3, "over_floor": ms / 1e3 / floor,
                             "ok": (ms / 1e3 / floor <= TARGETS["decode_b64_over_floor"]) if b == 64 else None})
            if graphs is not None and b == args.decode_batches[min(1, len(args.decode_batches) - 1)]:
                runner.cuda_graphs = None
                eager_logits = runner.execute_model(output)
                runner.cuda_graphs = graphs
                graph_logits = runner.execute_model(output)
                err = ((graph_logits - eager_logits).norm() / eager_logits.norm()).item()
                rows.append({"iteration": f"{name} graph vs eager logits b={b}", "rel_error": err,
                             "ok": err < TARGETS["bf16_rel_error"]})
        runner.cuda_graphs = None
        output, _ = engine_iteration(mixed, 16, shape.vocab_size)
        ms = wall_ms(lambda: executor.execute(output), args.reps)
        flops = iteration_flops(shape, mixed, sampled_rows=len(mixed))
        rows.append({"iteration": f"{name} mixed {args.mixed_tokens} tok ({args.mixed_decodes} dec + chunk)", "ms": ms,
                     "floor_ms": flops / rate * 1e3, "tflops": flops / (ms / 1e3) / 1e12,
                     "matmul_fraction": flops / (ms / 1e3) / rate,
                     "ok": flops / (ms / 1e3) / rate >= TARGETS["mixed_matmul_fraction"]})
        del runner, executor, graphs
        torch.cuda.empty_cache()
    table(rows, [("iteration", "iteration", ""), ("ms", "ms", ".2f"), ("floor_ms", "floor ms", ".2f"),
                 ("over_floor", "x floor", ".2f"), ("tflops", "TFLOP/s", ".0f"),
                 ("matmul_fraction", "of matmul", ".2f"), ("rel_error", "rel err", ".1e"), ("ok", "ok", "")])


def dry_run(args, report: Report) -> None:
    """Everything that needs no GPU: the plan's shapes and floors, every batch built and run through the
    engine's own code on the CPU with a two-layer model of the same attention shape, index construction."""
    import torch

    from stallfree.kernels import torch_reference
    from stallfree.kernels.flashinfer_index import build_paged_kv_indices
    from stallfree.node_daemon.engine.config import CacheConfig
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.engine.cuda_graphs import graph_batch_sizes
    from stallfree.node_daemon.engine.model_runner import ModelRunner
    from stallfree.node_daemon.models.llama import LlamaForCausalLM
    from stallfree.node_daemon.models.loader import LoadedModel
    from stallfree.node_daemon.models.random_weights import init_random_weights
    from stallfree.shapes import get_shape

    from batches import CORRECTNESS_CASES, attention_inputs, decode_batch, engine_iteration, mixed_batch
    from roofline import Sequence, decode_floor_s, iteration_flops, kv_bytes_read, weight_bytes_read

    shape = get_shape(args.model)
    bw, rate = NOMINAL_H200["copy_bandwidth_bytes_s"], NOMINAL_H200["bf16_matmul_flop_s"]
    mixed = mixed_batch(args.mixed_tokens, args.mixed_decodes, args.engine_context, args.chunk_prefix)

    def plan(rows: list[dict]) -> None:
        for b in args.decode_batches:
            batch = decode_batch(b, args.engine_context)
            rows.append({"iteration": f"decode b={b} ctx={args.engine_context}",
                         "weight_gb": weight_bytes_read(shape, b) / 1e9, "kv_gb": kv_bytes_read(shape, batch) / 1e9,
                         "floor_ms": decode_floor_s(shape, batch, bw) * 1e3})
        flops = iteration_flops(shape, mixed, sampled_rows=len(mixed))
        rows.append({"iteration": f"mixed {args.mixed_tokens} tok", "tflop": flops / 1e12, "floor_ms": flops / rate * 1e3})
        print(f"CUDA-graph buckets at the serving default max_num_seqs 256: {graph_batch_sizes(256)}")
        print(f"nominal H200 ceilings (KINDS.md): {bw / 1e12:.1f} TB/s copy, {rate / 1e12:.0f} TFLOP/s bf16")
        table(rows, [("iteration", "iteration", ""), ("weight_gb", "weights GB", ".2f"), ("kv_gb", "KV GB", ".2f"),
                     ("tflop", "TFLOP", ".2f"), ("floor_ms", "floor ms", ".2f")])

    def batches(rows: list[dict]) -> None:
        gen = torch.Generator().manual_seed(args.seed)
        for case, specs in CORRECTNESS_CASES.items():
            batch = [Sequence(q, s) for q, s in specs]
            q, k, v, md = attention_inputs(batch, 4, 1, 32, 16, torch.float32, torch.device("cpu"), gen)
            idx = build_paged_kv_indices(md)
            out = torch_reference.paged_attention(q, k, v, md, 32 ** -0.5)
            ref = torch_reference.paged_attention(q.double(), k.double(), v.double(), md, 32 ** -0.5,
                                                  compute_dtype=torch.float64)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            rows.append({"check": f"attention batch {case}", "tokens": q.shape[0], "pages": idx.num_pages,
                         "rel_error": err, "ok": err < 1e-5 and idx.num_pages == sum(-(-s.seq_len // 16) for s in batch)})
        # The engine iterations at full token counts, through the real runner, on a 2-layer model of the
        # same attention shape (the layer count and widths change nothing in the batch construction).
        small = shape.with_(num_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1024,
                            num_heads=8, num_kv_heads=2, head_dim=32)
        model = LlamaForCausalLM(small, torch.float32, "cpu", args.max_model_len)
        init_random_weights(model, args.seed)
        loaded = LoadedModel(model, small, (), None, args.max_model_len, None, "random")
        iterations = [(f"decode b={b}", decode_batch(b, args.engine_context)) for b in args.decode_batches]
        iterations.append(("mixed", mixed))
        blocks = max(sum(-(-s.seq_len // 16) for s in batch) for _, batch in iterations) + 16
        runner = ModelRunner(ModelConfig(model=args.model, device="cpu", max_model_len=args.max_model_len),
                             CacheConfig(block_size=16, num_blocks=blocks, enable_prefix_caching=False),
                             max_num_tokens=args.mixed_tokens, max_num_seqs=max(args.decode_batches), loaded=loaded)
        for label, batch in iterations:
            output, _ = engine_iteration(batch, 16, small.vocab_size)
            inputs = runner.prepare_inputs(output)
            row = {"check": f"engine iteration {label}", "tokens": inputs.input_ids.shape[0],
                   "pages": int(sum(-(-s // 16) for s in inputs.metadata.seq_lens_host))}
            if label in ("mixed", f"decode b={args.decode_batches[0]}"):
                logits = runner.execute_model(output)
                row["ok"] = bool(torch.isfinite(logits).all() and logits.shape[0] == len(batch))
            else:
                row["ok"] = inputs.is_decode_only and inputs.metadata.num_seqs == len(batch)
            rows.append(row)
        table(rows, [("check", "check", ""), ("tokens", "tokens", "d"), ("pages", "pages", "d"),
                     ("rel_error", "rel err", ".1e"), ("ok", "ok", "")])

    report.run("plan", 1, plan)
    report.run("batches", 30, batches)
