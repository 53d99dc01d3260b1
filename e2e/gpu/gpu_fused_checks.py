"""The fused-ops section of the GPU check: flashinfer's RMSNorm, add+RMSNorm, SiLU-and-mul, RoPE and top-k/top-p
sampling (kernels/fused_ops.py) against the torch paths, in bf16, with the speed-up where they pay.

A row says which path ran. On CUDA an op that fell back to torch (flashinfer absent, its kernel not carried)
compared torch with torch: its fused kernel is then unmeasured, not passed.
"""
from __future__ import annotations

import statistics

from gpu_report import TARGETS
from gpu_timing import events_ms

OPS_KEYS = {"rms_norm": "rms_norm", "fused_add_rms_norm": "fused_add_rms_norm", "silu_and_mul": "silu_and_mul",
            "rope": "rope", "top_k_top_p_sample": "sampling"}


def _path(op: str, device) -> str:
    from stallfree.kernels import fused_ops

    took = device.type == "cuda" and fused_ops.flashinfer_module() is not None and op not in fused_ops.unavailable_ops()
    return "flashinfer" if took else "torch"


def fused_ops_section(report, device, scale, reps: int) -> None:
    import torch

    from stallfree.kernels import fused_ops
    from stallfree.node_daemon.models.rope import RotaryEmbedding

    f = scale.fused
    hidden, inter, heads, kv_heads, d = f["hidden"], f["inter"], f["heads"], f["kv_heads"], f["head_dim"]
    rotary = RotaryEmbedding(d, 8192, 500000.0, None, device)
    target = f"rel err < {TARGETS['bf16_rel_error']:.0e}"
    for tokens in f["rows"]:
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.randn(hidden, device=device, dtype=torch.bfloat16)
        gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=torch.bfloat16)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=device, dtype=torch.bfloat16)
        pos = torch.randint(0, 8192, (tokens,), device=device)
        logits = torch.randn(tokens, f["vocab"], device=device) * 3

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
            check = f"{op} {tokens} rows"
            try:
                got, want = fused().float(), plain().float()
                err = ((got - want).norm() / want.norm()).item()
                t_fused = statistics.median(events_ms(fused, 3, 10 * reps, device))
                t_plain = statistics.median(events_ms(plain, 3, 10 * reps, device))
                path = _path(OPS_KEYS[op], device)
                report.correct(check, f"rel err {err:.1e}; {path} {t_fused * 1e3:.1f} us vs torch "
                               f"{t_plain * 1e3:.1f} us ({t_plain / t_fused:.2f}x)", err < TARGETS["bf16_rel_error"],
                               target, rel_error=err, path=path, fused_us=t_fused * 1e3, torch_us=t_plain * 1e3)
                _fused_kernel_row(report, check, path, device)
            except Exception as exc:
                report.correct(check, f"{type(exc).__name__}: {exc}", False, target)
        check = f"top_k_top_p_sample {tokens} rows"
        top_k = torch.full((tokens,), 50, device=device, dtype=torch.int32)
        top_p = torch.full((tokens,), 0.9, device=device, dtype=torch.float32)
        try:
            t = statistics.median(events_ms(lambda: fused_ops.top_k_top_p_sample(logits, top_k, top_p), 3, 5 * reps,
                                            device))
            picked = fused_ops.top_k_top_p_sample(logits, top_k, top_p)
            inside = bool((logits.gather(1, picked.unsqueeze(1)) >= logits.topk(50, dim=-1).values[:, -1:]).all())
            path = _path("sampling", device)
            report.correct(check, f"{'all' if inside else 'NOT all'} draws in the top 50; {path} {t * 1e3:.1f} us",
                           inside, "every draw inside top-k", path=path, fused_us=t * 1e3)
            _fused_kernel_row(report, check, path, device)
        except Exception as exc:
            report.correct(check, f"{type(exc).__name__}: {exc}", False, "every draw inside top-k")


def _fused_kernel_row(report, check: str, path: str, device) -> None:
    """On CUDA the fused kernel itself must have run: torch against torch proves nothing about it."""
    if device.type == "cuda" and path != "flashinfer":
        from stallfree.kernels import fused_ops

        why = "; ".join(f"{k}: {v}" for k, v in fused_ops.unavailable_ops().items()) or "torch path taken"
        report.unmeasured(f"{check}: flashinfer kernel", "the fused kernel runs", why)
