"""The kernel-level sections of the GPU check: backends, ceilings, attention correctness and timing.

Every section adds its rows through the Report (gpu_report.py), each with a verdict. Without CUDA (the dry run)
the same code runs on the CPU: Triton under its interpreter, timers on the host clock (gpu_timing.py).
"""
from __future__ import annotations

import math
import statistics

from gpu_report import TARGETS
from gpu_timing import empty_cache, events_ms, graph_time_ms, synchronize

REL_ERR = f"rel err < {TARGETS['bf16_rel_error']:.0e}, no NaN"


OPTIONAL_BACKENDS = ("flashinfer",)  # torch and Triton come with torch: one that will not run is a failure


def backends_section(report, device, names: list[str], scale) -> dict:
    """Instantiate and probe each backend: torch and Triton must run; flashinfer may be absent (skipped, with the
    reason; its targets are then unmeasured)."""
    from stallfree.kernels.selection import select_backend

    backends = {}
    for name in names:
        try:
            backend = select_backend(name, device)
            probe(backend, device, scale)
            backends[name] = backend
            family = getattr(backend, "_kernel_backend", None)
            report.correct(f"backend {name}", "ready" + (f" (kernel family {family})" if family else ""), True, "runs")
        except Exception as exc:  # flashinfer absent, or its kernels neither carried nor compilable: skip, say why
            why = f"{type(exc).__name__}: {exc}"
            report.data.setdefault("missing_backends", {})[name] = why
            if name in OPTIONAL_BACKENDS:
                report.skipped_row(f"backend {name}", why)
            else:
                report.correct(f"backend {name}", why, False, "runs")
    return backends


def probe(backend, device, scale) -> None:
    """One tiny mixed batch per head shape the checks use, so a missing kernel shows before any timing."""
    import torch

    from batches import attention_inputs
    from roofline import Sequence

    gen = torch.Generator().manual_seed(0)
    for _, heads, kv_heads, head_dim in scale.correctness_shapes:
        q, k, v, md = attention_inputs([Sequence(1, 20), Sequence(7, 30)], heads, kv_heads, head_dim, 16,
                                       torch.bfloat16, device, gen)
        run_backend(backend, q, k, v, md, head_dim ** -0.5)
    synchronize(device)


def run_backend(backend, query, k_cache, v_cache, metadata, scale):
    backend.begin_iteration(metadata)
    return backend.forward(query, k_cache, v_cache, metadata, scale)


def measure_ceilings(device, scale) -> dict:
    """Copy bandwidth (bytes read + written) and the bf16 matrix rate on random data (zeros run faster)."""
    import torch

    n = scale.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_ms = statistics.median(events_ms(lambda: dst.copy_(src), 3, 10, device))
    del src, dst
    m = scale.matmul_n
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_ms = statistics.mean(events_ms(lambda: a @ b, 3, 10, device))
    return {"copy_bandwidth_bytes_s": 2 * n / (copy_ms / 1e3), "bf16_matmul_flop_s": 2 * m ** 3 / (mm_ms / 1e3),
            "copy_ms": copy_ms, "matmul_ms": mm_ms}


def ceilings_section(report, device, scale) -> None:
    got = measure_ceilings(device, scale)
    report.set_ceilings(got, f"this {device.type}, {scale.copy_bytes >> 20} MiB copy, {scale.matmul_n}^3 bf16 matmul")
    report.info("copy bandwidth (read + write)", f"{got['copy_bandwidth_bytes_s'] / 1e12:.3f} TB/s", **got)
    report.info("bf16 matmul rate", f"{got['bf16_matmul_flop_s'] / 1e12:.1f} TFLOP/s")


def correctness_section(report, backends: dict, device, scale, seed: int) -> None:
    """Every backend against the float64 reference in bf16; outputs poisoned with NaN; KV write exact."""
    import torch

    from stallfree.kernels import torch_reference
    from stallfree.kernels.triton_attention import paged_attention as triton_paged_attention

    from batches import CASE_SETS, attention_inputs
    from roofline import Sequence

    gen = torch.Generator().manual_seed(seed)
    for model, heads, kv_heads, head_dim in scale.correctness_shapes:
        for case, specs in CASE_SETS[scale.correctness_cases].items():
            for page in scale.pages:
                batch = [Sequence(q, s) for q, s in specs]
                q, k, v, md = attention_inputs(batch, heads, kv_heads, head_dim, page, torch.bfloat16, device, gen)
                sm_scale = head_dim ** -0.5
                ref = torch_reference.paged_attention(q.double(), k.double(), v.double(), md, sm_scale,
                                                      compute_dtype=torch.float64)
                for name, backend in backends.items():
                    check = f"{name} {model} {case} page {page}"
                    try:
                        out = run_backend(backend, q, k, v, md, sm_scale)
                        poisoned = torch.full_like(q, float("nan"))
                        if name == "triton":
                            triton_paged_attention(q, k, v, md, sm_scale, out=poisoned)
                        elif name == "flashinfer":
                            backend._wrapper.run(q, (k, v), out=poisoned)
                        else:
                            poisoned = out  # the torch path allocates its own output
                        err = ((out.double() - ref).norm() / ref.norm()).item()
                        worst = ((out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max().item()
                        unwritten = int(torch.isnan(poisoned).sum())
                        ok = err < TARGETS["bf16_rel_error"] and unwritten == 0 and bool(torch.isfinite(out).all())
                        report.correct(check, f"rel err {err:.1e} (worst token {worst:.1e}), {unwritten} NaN left", ok,
                                       REL_ERR, rel_error=err, worst_token_rel_error=worst, unwritten=unwritten)
                    except Exception as exc:
                        report.correct(check, f"{type(exc).__name__}: {exc}", False, REL_ERR)
        # KV write: exact against the torch scatter, a third of the slots -1 (skipped).
        mixed = [Sequence(a, b) for a, b in CASE_SETS[scale.correctness_cases]["mixed"]]
        q, k, v, md = attention_inputs(mixed, heads, kv_heads, head_dim, scale.pages[0], torch.bfloat16, device, gen)
        key = torch.randn(q.shape[0], kv_heads, head_dim, device=device).to(torch.bfloat16)
        slots = md.slot_mapping.clone()
        slots[::3] = -1
        for name, backend in backends.items():
            k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
            backend.write_kv(key, key, k1, v1, slots)
            torch_reference.write_kv(key, key, k2, v2, slots)
            same = bool(torch.equal(k1, k2) and torch.equal(v1, v2))
            report.correct(f"{name} {model} write_kv (1/3 slots -1)", "bit-exact" if same else "differs", same,
                           "bit-exact vs the torch scatter")


def attention_section(report, backends: dict, device, scale, args) -> None:
    """One layer's attention, Triton and flashinfer, by graph replay over enough caches to stream past the L2."""
    import torch

    from stallfree.kernels.triton_attention import KernelConfig, paged_attention
    from stallfree.shapes import get_shape

    from batches import attention_inputs, decode_batch, mixed_batch
    from roofline import attention_flops, attention_kv_bytes

    shape = get_shape(scale.attention_model)
    gen = torch.Generator().manual_seed(args.seed + 1)
    cases = [(f"decode b={b} ctx={args.attn_context}", decode_batch(b, args.attn_context)) for b in args.decode_batches]
    cases.append((f"decode b=1 ctx={4 * args.attn_context} (split-KV)", decode_batch(1, 4 * args.attn_context)))
    cases.append((f"mixed {args.mixed_tokens} tok ({args.mixed_decodes} dec + chunk over {args.chunk_prefix})",
                  mixed_batch(args.mixed_tokens, args.mixed_decodes, args.attn_context, args.chunk_prefix)))
    bw, rate = report.ceilings["copy_bandwidth_bytes_s"], report.ceilings["bf16_matmul_flop_s"]
    sm_scale = shape.head_dim ** -0.5
    sweep = {"decode": [KernelConfig(16, 64, 4, 2), KernelConfig(16, 128, 4, 2), KernelConfig(16, 64, 4, 3)],
             "mixed": [KernelConfig(128, 64, 8, 2), KernelConfig(128, 64, 8, 3), KernelConfig(128, 32, 8, 2),
                       KernelConfig(64, 64, 8, 2), KernelConfig(64, 64, 4, 2)]}
    ratio_target = f"<= {TARGETS['triton_over_flashinfer']}x"
    for label, batch in cases:
        kv_bytes = attention_kv_bytes(shape, batch)
        layers = max(1, min(32, math.ceil(scale.stream_bytes / kv_bytes)))
        inputs = [attention_inputs(batch, shape.num_heads, shape.num_kv_heads, shape.head_dim, 16, torch.bfloat16,
                                   device, gen) for _ in range(layers)]
        md = inputs[0][3]  # one metadata for every layer, as in the engine (every cache has the same blocks)
        floor_s = max(kv_bytes / bw, attention_flops(shape, batch) / rate)
        times = {}
        for name, backend in backends.items():
            if name == "torch":
                continue  # a Python loop per sequence: not a serving kernel
            try:
                backend.begin_iteration(md)
                calls = [lambda b=backend, x=x: b.forward(x[0], x[1], x[2], md, sm_scale) for x in inputs]
                ms = graph_time_ms(calls, device, args.reps)
                times[name] = ms
                report.info(f"{label} {name}", f"{ms * 1e3:.1f} us, {ms / 1e3 / floor_s:.2f}x floor, "
                            f"{kv_bytes / (ms / 1e3) / 1e9:.0f} GB/s", us=ms * 1e3, over_floor=ms / 1e3 / floor_s)
            except Exception as exc:
                report.correct(f"{label} {name} timed", f"{type(exc).__name__}: {exc}", False, "runs")
        if "triton" in times and "flashinfer" in times:
            ratio = times["triton"] / times["flashinfer"]
            report.target(f"{label} triton/flashinfer", f"{ratio:.2f}x", ratio <= TARGETS["triton_over_flashinfer"],
                          ratio_target, ratio=ratio)
        else:
            absent = [n for n in ("triton", "flashinfer") if n not in times]
            report.unmeasured(f"{label} triton/flashinfer", ratio_target, f"no {' or '.join(absent)} timing")
        if "triton" in backends and args.sweep and report.left_s() > 60:
            kind = "decode" if batch[-1].q_len == 1 else "mixed"
            for config in sweep[kind][:scale.sweep_limit]:
                name = f"triton {config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}"
                try:
                    calls = [lambda x=x, c=config: paged_attention(x[0], x[1], x[2], md, sm_scale, config=c)
                             for x in inputs]
                    ms = graph_time_ms(calls, device, args.reps)
                    report.info(f"{label} {name}", f"{ms * 1e3:.1f} us, {ms / 1e3 / floor_s:.2f}x floor", us=ms * 1e3)
                except Exception as exc:  # a launch shape the chip cannot take: say so, it is only a sweep
                    report.info(f"{label} {name}", f"{type(exc).__name__}: {exc}")
        del inputs
        empty_cache(device)
