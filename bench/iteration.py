"""`stallfree bench iteration`: where a decode iteration's time goes, host against forward.

For each count of running sequences (default 1, 16, 64) it runs decode iterations straight through the
model runner and the sampler (no scheduler, no HTTP) and times three parts of each: input preparation
(the ragged batch and its index tensors), the forward (model and logits) and sampling (greedy). It prints
one row per count with medians in milliseconds, the host share and the decode rate, and writes JSON.
`--breakdown` also splits each forward into weight matmuls, attention, other ATen ops and Python
(bench/op_breakdown.py), with the count of ATen ops one forward dispatches, the weight bytes it reads and how
long reading them takes at the machine's measured copy bandwidth: what bounds a decode step.
Every sequence has `--context` tokens cached (the KV content does not change the time).
`--chunk C --prefix P` makes every iteration a mixed one, as a serving load runs them: the row's decodes (0 allowed)
plus one C-token prefill chunk over a P-token cached prefix; the rate then counts the chunk's tokens too.
`--ab-compiled` times the Python forward and the compiled forward (models/cpu_decode.py) on the same inputs,
alternately within every iteration (A/B side by side on a busy machine), and prints both with their ratio;
`--ab-code` the same for the compiled forward with the code kernel and with torch's int4 kernel (and oneDNN's) for its
matmuls (models/cpu_code_matmul.h).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


# The compiled forward's kinds of step, in the order models/cpu_decode.cpp's phase_seconds() gives them.
COMPILED_STEPS = ("norm", "matmul", "rope+kv", "decode attn", "chunk attn", "silu*up")


def _compiled_steps(forward, repeats: int = 5) -> dict[str, float]:
    """ms a forward in each kind of step of the compiled forward (its own clock between steps)."""
    import torch

    from stallfree.node_daemon.models import cpu_decode

    cpu_decode.ops().phase_seconds()  # zeroes the clock's sums
    for _ in range(repeats):
        forward()
    seconds = cpu_decode.ops().phase_seconds()
    return {name: round(s * 1000 / repeats, 3) for name, s in zip(COMPILED_STEPS, seconds)}


def _without_code_kernel(runner):
    """The runner's compiled forward again, its matmuls on torch's int4 kernel (STALLFREE_CPU_CODE_KERNEL=0)."""
    import os

    from stallfree.node_daemon.models import cpu_decode

    if runner.cpu_decode is None or not any(runner.cpu_decode.bits):
        raise SystemExit("stallfree bench iteration: --ab-code needs the compiled forward with the code kernel "
                         f"(a GGUF model): {cpu_decode.why_not() or 'not in use'}")
    saved = os.environ.get(cpu_decode.CODE_KERNEL_SWITCH)
    os.environ[cpu_decode.CODE_KERNEL_SWITCH] = "0"
    try:
        return cpu_decode.CpuDecode(runner.model, runner.kv_caches)
    finally:
        if saved is None:
            del os.environ[cpu_decode.CODE_KERNEL_SWITCH]
        else:
            os.environ[cpu_decode.CODE_KERNEL_SWITCH] = saved


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stallfree bench iteration", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton", "flashinfer"])
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0, help="0: the cores this process is given")
    p.add_argument("--seqs", default="1,16,64", help="running sequences per iteration, comma-separated")
    p.add_argument("--context", type=int, default=128, help="cached tokens per sequence")
    p.add_argument("--iterations", type=int, default=20, help="timed iterations per row (after 3 warm-ups)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=0,
                   help="mixed iterations: the decodes plus one prefill chunk of this many tokens (0: decode only)")
    p.add_argument("--prefix", type=int, default=0, help="cached tokens before the --chunk (its prompt's prefix)")
    p.add_argument("--ab-code", action="store_true",
                   help="time the compiled forward with the code kernel and with torch's int4 kernel for its few-row "
                        "matmuls (the LM head's too) alternately on the same inputs (implies the build)")
    p.add_argument("--breakdown", action="store_true",
                   help="also split each forward into weight matmuls, attention, other ops and Python (profiler)")
    p.add_argument("--compile", action="store_true",
                   help="run the model's forward through torch.compile (inductor, dynamic shapes): the engine does "
                        "not, this measures whether it would pay")
    p.add_argument("--compiled-decode", default="off", choices=["off", "now"],
                   help="now: iterations take the compiled forward (models/cpu_decode.py), compiled first if needed")
    p.add_argument("--ab-compiled", action="store_true",
                   help="time the Python and the compiled forward alternately on the same inputs (implies the build)")
    p.add_argument("--json", default="runs/bench_iteration.json")
    return p.parse_args(argv)


def _compile_forward(runner) -> None:
    """Replace the model's forward by torch.compile's (under no_grad: inductor cannot take inference-mode
    tensors it mutates, the KV cache), compiled on its first call, which the warm-up iterations make."""
    import torch

    from stallfree.node_daemon.models.layers import Linear

    model = runner.model
    # Dynamo cannot trace oneDNN's opaque prepacked weights: the compiled forward takes the plain ones.
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed = None
    model.tied_lm_head_packed = None
    compiled = torch.compile(type(model).forward.__wrapped__, dynamic=True)

    def forward(*args):
        with torch.no_grad():
            return compiled(model, *args)

    model.forward = forward
    print("forward compiled by torch.compile on first use (its time shows in the first row's warm-up)", flush=True)


def _compiled_vs_eager(runner, inputs) -> float:
    """Relative difference of the compiled forward's logits from the eager one's on the same inputs."""
    model = runner.model
    runner.attn.begin_iteration(inputs.metadata)
    eager = type(model).forward(model, inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metadata,
                                runner.attn)
    want = model.compute_logits(eager[inputs.logits_indices])
    got = model.compute_logits(runner.run_model(inputs)[inputs.logits_indices])
    return float((got - want).abs().max() / want.abs().max())


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    counts = [int(n) for n in args.seqs.split(",") if n.strip()]
    if (not counts or min(counts) < (0 if args.chunk else 1) or args.context < 1 or args.iterations < 1
            or args.chunk < 0 or args.prefix < 0 or args.chunk == 1 or (args.ab_compiled and args.ab_code)):
        print("stallfree bench iteration: error: --seqs, --context and --iterations must be positive (--seqs may be 0 "
              "with --chunk), --chunk 0 or at least 2, --prefix not negative; at most one of --ab-compiled and "
              "--ab-code", file=sys.stderr)
        return 2
    from stallfree.bench.op_breakdown import count_ops, memory_bandwidth_gb_s, op_shares, weight_bytes_per_forward
    from stallfree.node_daemon.engine.config import CacheConfig
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.engine.model_runner import ModelRunner
    from stallfree.node_daemon.engine.request import Request
    from stallfree.node_daemon.engine.sampler import Sampler
    from stallfree.node_daemon.engine.sampling_params import SamplingParams
    from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput

    steps = args.iterations + 3
    bs = args.block_size
    blocks_per_seq = -(-(args.context + steps + 1) // bs)
    chunk_blocks = -(-(args.prefix + args.chunk) // bs) if args.chunk else 0
    started = time.monotonic()
    if args.ab_code:  # torch's int4 packs stay: the B side's forward reads them
        ModelRunner._release_int4_packs = lambda self: None
    runner = ModelRunner(ModelConfig(model=args.model, device=args.device, dtype=args.dtype,
                                     attention_backend=args.attention_backend, threads=args.threads,
                                     compiled_decode="now" if args.ab_compiled or args.ab_code
                                     else args.compiled_decode),
                         CacheConfig(block_size=bs, num_blocks=max(counts) * blocks_per_seq + chunk_blocks + 1),
                         max_num_tokens=max(counts) + args.chunk, max_num_seqs=max(counts) + 1)
    print(f"loaded {args.model} in {time.monotonic() - started:.1f} s: {runner.loaded.dtype}, "
          f"attention {runner.attn.name}, threads {runner.threads}", flush=True)
    if args.compile:
        _compile_forward(runner)
    int4_decode = _without_code_kernel(runner) if args.ab_code else None
    weights = runner.model.int4_weights()
    code_kernels = [w.code_kernel for w in weights]  # this model's, set aside for the torch int4 runs
    sampler = Sampler(runner.device)
    greedy = SamplingParams(max_tokens=steps + 1, temperature=0.0)
    rows = []
    prefill = None
    if args.chunk:  # its chunk rewrites the same slots every iteration; the prefix's KV content does not matter
        span = min(1000, runner.loaded.shape.vocab_size - 10)  # token ids within any model's vocabulary
        prefill = Request("chunk", [(11 * j) % span + 10 for j in range(args.prefix + args.chunk)], greedy)
        first = 1 + max(counts) * blocks_per_seq
        prefill.block_ids = list(range(first, first + chunk_blocks))
        print(f"mixed iterations: the decodes plus a {args.chunk}-token chunk over a {args.prefix}-token prefix")
    print(f"{'seqs':>5} {'prep ms':>8} {'forward ms':>10} {'sample ms':>9} {'host %':>7} {'tok/s':>8}")
    for n in counts:
        reqs = []
        for i in range(n):
            req = Request(f"s{n}-{i}", [(7 * i + j) % 1000 + 10 for j in range(args.context)], greedy)
            req.block_ids = list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
            req.num_computed_tokens = args.context - 1
            reqs.append(req)
        ids = [r.request_id for r in reqs] + ([prefill.request_id] if prefill else [])
        params = [greedy] * len(ids)
        prep, fwd, samp, fwd_b = [], [], [], []
        compiled = runner.cpu_decode
        warmup_s = 0.0  # the 3 untimed iterations (with --compile: compilation for this shape)
        for step in range(steps):
            output = SchedulerOutput(chunks=[ScheduledChunk(r, r.num_tokens - 1, 1, is_prefill=False, samples=True)
                                             for r in reqs])
            if prefill is not None:
                output.chunks.append(ScheduledChunk(prefill, args.prefix, args.chunk, is_prefill=True, samples=True))
            t0 = time.perf_counter()
            inputs = runner.prepare_inputs(output)
            prepared = time.perf_counter()
            if args.ab_compiled:  # B first: the compiled forward on the same inputs (rewrites the same KV slots)
                tb = time.perf_counter()
                runner.model.compute_logits(runner.run_model(inputs)[inputs.logits_indices])
                fwd_b.append(time.perf_counter() - tb)
                runner.cpu_decode = None
            if int4_decode is not None:  # B first: torch's int4 kernel for the few-row matmuls, same inputs
                runner.cpu_decode = int4_decode
                runner.model.use_code_kernel(None, 0)
                tb = time.perf_counter()
                runner.model.compute_logits(runner.run_model(inputs)[inputs.logits_indices])
                fwd_b.append(time.perf_counter() - tb)
                runner.cpu_decode = compiled
                for weight, kernel in zip(weights, code_kernels):
                    weight.code_kernel = kernel
            t1 = time.perf_counter()
            logits = runner.model.compute_logits(runner.run_model(inputs)[inputs.logits_indices])
            t2 = time.perf_counter()
            runner.cpu_decode = compiled
            tokens = sampler.sample(logits, params, ids)
            t3 = time.perf_counter()
            for r, tok in zip(reqs, tokens[:n]):
                r.append_output_token(tok)
                r.num_computed_tokens = r.num_tokens - 1
            if step >= 3:
                prep.append(prepared - t0), fwd.append(t2 - t1), samp.append(t3 - t2)
            else:
                warmup_s += t3 - t0
        p, f, s = (statistics.median(x) * 1000 for x in (prep, fwd, samp))
        total = p + f + s
        row = {"seqs": n, "context": args.context, "chunk": args.chunk, "prefix": args.prefix,
               "prepare_ms": round(p, 3), "forward_ms": round(f, 3), "sample_ms": round(s, 3),
               "host_share": round((p + s) / total, 4), "tokens_per_s": round((n + args.chunk) / total * 1000, 1),
               "warmup_s": round(warmup_s, 2)}
        if args.ab_compiled:
            row["compiled_forward_ms"] = round(statistics.median(fwd_b[3:]) * 1000, 3)
            row["python_over_compiled"] = round(f / row["compiled_forward_ms"], 3)
            print(f"      compiled forward: {row['compiled_forward_ms']:.2f} ms "
                  f"({row['python_over_compiled']:.2f}x faster than the Python forward beside it)", flush=True)
        if int4_decode is not None:
            row["int4_forward_ms"] = round(statistics.median(fwd_b[3:]) * 1000, 3)
            row["int4_over_code"] = round(row["int4_forward_ms"] / f, 3)
            print(f"      with torch's int4 kernel instead: {row['int4_forward_ms']:.2f} ms (the code kernel "
                  f"{row['int4_over_code']:.2f}x faster beside it)", flush=True)
        if args.compile:
            row["compiled_vs_eager"] = _compiled_vs_eager(runner, runner.prepare_inputs(output))
            print(f"      compiled against eager logits: max |diff| / max |logit| {row['compiled_vs_eager']:.2e}",
                  flush=True)
        if args.breakdown:
            inputs = runner.prepare_inputs(output)  # the last step's shape, re-run (the KV slot is rewritten)
            forward = lambda: runner.model.compute_logits(runner.run_model(inputs)[inputs.logits_indices])  # noqa: E731
            shares = op_shares(forward)
            base = row.get("compiled_forward_ms", f)  # with --ab-compiled the profiled forward is the compiled one
            row["forward_split_ms"] = {kind: round(share * base, 3) for kind, share in shares.items()}
            row["aten_ops_per_forward"] = count_ops(forward)
            row["weight_mb_per_forward"] = round(weight_bytes_per_forward(runner.model, n + args.chunk) / 1e6, 1)
            if runner.cpu_decode is not None and runner.cpu_decode.can_run(n + args.chunk, decode_only=not args.chunk):
                row["compiled_steps_ms"] = _compiled_steps(forward)
        rows.append(row)
        print(f"{n:>5} {p:>8.2f} {f:>10.2f} {s:>9.2f} {100 * row['host_share']:>6.1f}% {row['tokens_per_s']:>8.1f}"
              + (f"  (warm-up and compile {warmup_s:.1f} s)" if args.compile else ""), flush=True)
    if args.breakdown:
        bandwidth = memory_bandwidth_gb_s()
        print(f"forward split (profiler shares of the median forward, ms); memory copy bandwidth {bandwidth:.1f} GB/s:")
        print(f"{'seqs':>5} {'matmul':>8} {'attention':>10} {'other ops':>10} {'python':>8} {'ATen ops':>9} "
              f"{'weights MB':>10} {'at bandwidth':>12}")
        for row in rows:
            split = row["forward_split_ms"]
            row["weight_read_ms_at_bandwidth"] = round(row["weight_mb_per_forward"] / bandwidth, 3)
            print(f"{row['seqs']:>5} {split['matmul']:>8.2f} {split['attention']:>10.2f} {split['other_ops']:>10.2f} "
                  f"{split['python']:>8.2f} {row['aten_ops_per_forward']:>9} {row['weight_mb_per_forward']:>10.1f} "
                  f"{row['weight_read_ms_at_bandwidth']:>9.2f} ms")
        stepped = [row for row in rows if "compiled_steps_ms" in row]
        if stepped:
            print("the compiled forward by step (ms a forward; the LM head runs after it, under matmul above):")
            print(f"{'seqs':>5} " + " ".join(f"{name:>10}" for name in COMPILED_STEPS))
            for row in stepped:
                steps = row["compiled_steps_ms"]
                print(f"{row['seqs']:>5} " + " ".join(f"{steps[name]:>10.2f}" for name in COMPILED_STEPS))
        result_extra = {"memory_bandwidth_gb_s": round(bandwidth, 2)}
    else:
        result_extra = {}
    result = {"model": args.model, "dtype": str(runner.loaded.dtype).removeprefix("torch."),
              "attention_backend": runner.attn.name, "threads": runner.threads, "rows": rows, **result_extra}
    if args.json:
        import os

        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
