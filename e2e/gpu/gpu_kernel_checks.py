"""The kernel-level sections of the GPU check: ceilings, attention correctness and timing, fused ops."""
from __future__ import annotations

import math
import statistics

from gpu_report import TARGETS, table
from gpu_timing import cuda_events_ms, graph_time_ms


def measure_ceilings(device) -> dict:
    import torch

    n = 2 << 30  # 2 GiB each way: far past the 60 MB L2
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_ms = statistics.median(cuda_events_ms(lambda: dst.copy_(src), 3, 10))
    bandwidth = 2 * n / (copy_ms / 1e3)
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)  # random, never zeros: zeros run faster
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_ms = statistics.mean(cuda_events_ms(lambda: a @ b, 3, 10))
    rate = 2 * m ** 3 / (mm_ms / 1e3)
    return {"copy_bandwidth_bytes_s": bandwidth, "bf16_matmul_flop_s": rate, "copy_ms": copy_ms, "matmul_ms": mm_ms}


def make_backends(device, names: list[str]) -> tuple[dict, dict]:
    """Instantiate each backend; those that cannot run are returned as name -> reason."""
    from stallfree.kernels.selection import select_backend

    backends, missing = {}, {}
    for name in names:
        try:
            backend = select_backend(name, device)
            probe(backend, device)
            backends[name] = backend
        except Exception as exc:  # flashinfer absent, or its kernels neither carried nor compilable: skip, say why
            missing[name] = f"{type(exc).__name__}: {exc}"
    return backends, missing


def probe(backend, device) -> None:
    """One tiny mixed batch per head_dim the checks use, so a missing kernel shows before any timing."""
    import torch

    from batches import attention_inputs
    from roofline import Sequence

    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, head_dim in ((32, 8, 128), (9, 3, 64)):
        q, k, v, md = attention_inputs([Sequence(1, 20), Sequence(7, 30)], heads, kv_heads, head_dim, 16,
                                       torch.bfloat16, device, gen)
        run_backend(backend, q, k, v, md, head_dim ** -0.5)
    torch.cuda.synchronize(device)


def run_backend(backend, query, k_cache, v_cache, metadata, scale):
    backend.begin_iteration(metadata)
    return backend.forward(query, k_cache, v_cache, metadata, scale)


def check_correctness(backends: dict, device, rows: list[dict], seed: int) -> None:
    import torch

    from stallfree.kernels import torch_reference
    from stallfree.kernels.triton_attention import paged_attention as triton_paged_attention

    from batches import CORRECTNESS_CASES, attention_inputs
    from roofline import Sequence

    gen = torch.Generator().manual_seed(seed)
    shapes = [("llama-3-8b", 32, 8, 128), ("smollm2-135m", 9, 3, 64)]
    for model, heads, kv_heads, head_dim in shapes:
        for case, specs in CORRECTNESS_CASES.items():
            for page in (16, 32):
                batch = [Sequence(q, s) for q, s in specs]
                q, k, v, md = attention_inputs(batch, heads, kv_heads, head_dim, page, torch.bfloat16, device, gen)
                scale = head_dim ** -0.5
                ref = torch_reference.paged_attention(q.double(), k.double(), v.double(), md, scale,
                                                      compute_dtype=torch.float64)
                for name, backend in backends.items():
                    row = {"check": f"{name} {model} {case} page {page}"}
                    try:
                        out = run_backend(backend, q, k, v, md, scale)
                        poisoned = torch.full_like(q, float("nan"))
                        if name == "triton":
                            triton_paged_attention(q, k, v, md, scale, out=poisoned)
                        elif name == "flashinfer":
                            backend._wrapper.run(q, (k, v), out=poisoned)
                        else:
                            poisoned = out
                        err = (out.double() - ref).norm().item() / ref.norm().item()
                        per_token = ((out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max()
                        unwritten = int(torch.isnan(poisoned).sum())
                        row.update(rel_error=err, worst_token_rel_error=per_token.item(), unwritten=unwritten,
                                   ok=bool(err < TARGETS["bf16_rel_error"] and unwritten == 0
                                           and torch.isfinite(out).all()))
                    except Exception as exc:
                        row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                    rows.append(row)
                # KV write: exact against the torch scatter, slot -1 skipped.
                key = torch.randn(q.shape[0], kv_heads, head_dim, device=device).to(torch.bfloat16)
                slots = md.slot_mapping.clone()
                slots[::3] = -1
                for name, backend in backends.items():
                    if page == 32 or case != "mixed":
                        continue
                    k1, v1 = k.clone(), v.clone()
                    k2, v2 = k.clone(), v.clone()
                    backend.write_kv(key, key, k1, v1, slots)
                    torch_reference.write_kv(key, key, k2, v2, slots)
                    rows.append({"check": f"{name} {model} write_kv (1/3 slots -1)",
                                 "ok": bool(torch.equal(k1, k2) and torch.equal(v1, v2)), "rel_error": 0.0})
    table(rows, [("check", "check", ""), ("rel_error", "rel err", ".1e"),
                 ("worst_token_rel_error", "worst token", ".1e"), ("unwritten", "NaN left", "d"), ("ok", "ok", "")])


def attention_timing(backends: dict, device, ceilings: dict, args, report, rows: list[dict]) -> None:
    import torch

    from stallfree.kernels.triton_attention import KernelConfig, paged_attention
    from stallfree.shapes import get_shape

    from batches import attention_inputs, decode_batch, mixed_batch
    from roofline import attention_flops, attention_kv_bytes

    shape = get_shape("llama-3-8b")
    gen = torch.Generator().manual_seed(args.seed)
    cases = [(f"decode b={b} ctx={args.attn_context}", decode_batch(b, args.attn_context)) for b in args.decode_batches]
    cases.append((f"decode b=1 ctx={4 * args.attn_context} (split-KV)", decode_batch(1, 4 * args.attn_context)))
    cases.append((f"mixed {args.mixed_tokens} tok ({args.mixed_decodes} dec + chunk over {args.chunk_prefix})",
                  mixed_batch(args.mixed_tokens, args.mixed_decodes, args.attn_context, args.chunk_prefix)))
    bw, rate = ceilings["copy_bandwidth_bytes_s"], ceilings["bf16_matmul_flop_s"]
    scale = shape.head_dim ** -0.5
    sweep = {"decode": [KernelConfig(16, 64, 4, 2), KernelConfig(16, 128, 4, 2), KernelConfig(16, 64, 4, 3)],
             "mixed": [KernelConfig(128, 64, 8, 2), KernelConfig(128, 64, 8, 3), KernelConfig(128, 32, 8, 2),
                       KernelConfig(64, 64, 8, 2), KernelConfig(64, 64, 4, 2)]}
    for label, batch in cases:
        kv_bytes = attention_kv_bytes(shape, batch)
        # Enough distinct layers' caches that one graph replay streams well past the L2, as a model does.
        layers = max(1, min(32, math.ceil((512 << 20) / kv_bytes)))
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
                calls = [lambda b=backend, x=x: b.forward(x[0], x[1], x[2], md, scale) for x in inputs]
                ms = graph_time_ms(calls)
                times[name] = ms
                rows.append({"case": label, "backend": name, "us": ms * 1e3, "over_floor": ms / 1e3 / floor_s,
                             "tflops": attention_flops(shape, batch) / (ms / 1e3) / 1e12,
                             "gb_s": kv_bytes / (ms / 1e3) / 1e9})
            except Exception as exc:
                rows.append({"case": label, "backend": name, "error": f"{type(exc).__name__}: {exc}"})
        if "triton" in times and "flashinfer" in times:
            rows.append({"case": label, "backend": "triton/flashinfer", "ratio": times["triton"] / times["flashinfer"],
                         "ok": times["triton"] / times["flashinfer"] <= TARGETS["triton_over_flashinfer"]})
        if "triton" in backends and args.sweep and report.left_s() > 60:
            kind = "decode" if batch[-1].q_len == 1 else "mixed"
            for config in sweep[kind]:
                try:
                    calls = [lambda x=x, c=config: paged_attention(x[0], x[1], x[2], md, scale, config=c)
                             for x in inputs]
                    ms = graph_time_ms(calls)
                    rows.append({"case": label, "backend": f"triton {config.block_m}x{config.block_n} "
                                                          f"w{config.num_warps} s{config.num_stages}",
                                 "us": ms * 1e3, "over_floor": ms / 1e3 / floor_s})
                except Exception as exc:
                    rows.append({"case": label, "backend": f"triton {config}", "error": f"{type(exc).__name__}: {exc}"})
        del inputs
        torch.cuda.empty_cache()
    table(rows, [("case", "case", ""), ("backend", "backend", ""), ("us", "us/call", ".1f"),
                 ("over_floor", "x floor", ".2f"), ("gb_s", "KV GB/s", ".0f"), ("tflops", "TFLOP/s", ".1f"),
                 ("ratio", "ratio", ".2f"), ("ok", "ok", "")])


def fused_ops_check(device, rows: list[dict]) -> None:
    import torch

    from stallfree.kernels import fused_ops
    from stallfree.node_daemon.models.rope import RotaryEmbedding

    if fused_ops.flashinfer_module() is None:
        rows.append({"op": "all", "error": fused_ops.unavailable_ops().get("*", "flashinfer absent")})
        return
    hidden, inter, heads, kv_heads, d = 4096, 14336, 32, 8, 128
    rotary = RotaryEmbedding(d, 8192, 500000.0, None, device)
    for tokens in (64, 2048):
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.randn(hidden, device=device, dtype=torch.bfloat16)
        gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=torch.bfloat16)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=device, dtype=torch.bfloat16)
        pos = torch.randint(0, 8192, (tokens,), device=device)
        logits = torch.randn(tokens, 128256, device=device) * 3

        def rope(fn_inplace):
            q, k, _ = qkv.clone().split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
            fn_inplace(q, k)
            return torch.cat([q.flatten(1), k.flatten(1)], 1)

        def torch_rope(q, k):
            cos, sin = rotary.cos_sin_cache[pos].unsqueeze(1).chunk(2, dim=-1)
            q.copy_(fused_ops._rope_torch(q, cos, sin))
            k.copy_(fused_ops._rope_torch(k, cos, sin))

        ops = {
            "rms_norm": (lambda: fused_ops.rms_norm(x, w, 1e-5), lambda: fused_ops.rms_norm_torch(x, w, 1e-5)),
            "fused_add_rms_norm": (lambda: fused_ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)[0],
                                   lambda: fused_ops.rms_norm_torch(x + r, w, 1e-5)),
            "silu_and_mul": (lambda: fused_ops.silu_and_mul(gate_up),
                             lambda: torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]),
            "rope": (lambda: rope(lambda q, k: fused_ops.apply_rope_inplace(pos, q, k, rotary.cos_sin_cache)),
                     lambda: rope(torch_rope)),
        }
        for op, (fused, plain) in ops.items():
            try:
                got, want = fused().float(), plain().float()
                err = ((got - want).norm() / want.norm()).item()
                t_fused = statistics.median(cuda_events_ms(fused, 3, 20))
                t_plain = statistics.median(cuda_events_ms(plain, 3, 20))
                rows.append({"op": f"{op} {tokens} rows", "rel_error": err, "fused_us": t_fused * 1e3,
                             "torch_us": t_plain * 1e3, "speedup": t_plain / t_fused,
                             "ok": err < TARGETS["bf16_rel_error"]})
            except Exception as exc:
                rows.append({"op": f"{op} {tokens} rows", "error": f"{type(exc).__name__}: {exc}"})
        top_k = torch.full((tokens,), 50, device=device, dtype=torch.int32)
        top_p = torch.full((tokens,), 0.9, device=device, dtype=torch.float32)
        try:
            t_fused = statistics.median(cuda_events_ms(lambda: fused_ops.top_k_top_p_sample(logits, top_k, top_p), 3, 10))
            picked = fused_ops.top_k_top_p_sample(logits, top_k, top_p)
            inside = (logits.gather(1, picked.unsqueeze(1)) >= logits.topk(50, dim=-1).values[:, -1:]).all().item()
            rows.append({"op": f"top_k_top_p_sample {tokens} rows", "fused_us": t_fused * 1e3, "ok": bool(inside)})
        except Exception as exc:
            rows.append({"op": f"top_k_top_p_sample {tokens} rows", "error": f"{type(exc).__name__}: {exc}"})
    table(rows, [("op", "op", ""), ("rel_error", "rel err", ".1e"), ("fused_us", "fused us", ".1f"),
                 ("torch_us", "torch us", ".1f"), ("speedup", "speedup", ".2f"), ("ok", "ok", "")])
