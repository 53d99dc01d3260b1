"""Where a forward's time goes by kind of op, from torch.profiler: weight matmuls, attention, the rest.

The profiler's self time of every ATen op is summed per kind; what no op accounts for is Python and
dispatch. The profiler slows small ops down, so the kinds are reported as shares, which the caller
applies to the forward's unprofiled time.
"""
from __future__ import annotations

from typing import Callable

# The weight-only int4/int8 kernels, the compiled code kernel and dense GEMMs (the projections and the LM head).
MATMUL_OPS = {"aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "aten::mm", "aten::addmm",
              "aten::_weight_int4pack_mm", "mkldnn::_linear_pointwise", "stallfree_cpu_avx512_bf16::code_matmul", "stallfree_cpu_avx512::code_matmul",
              "stallfree_cpu_avx2::code_matmul", "stallfree_cpu_generic::code_matmul"}
# The KV cache's writes and gathers, the score and value products, softmax.
ATTENTION_OPS = {"aten::bmm", "aten::baddbmm", "aten::index_select", "aten::index_copy_", "aten::_softmax",
                 "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"}
KINDS = ("matmul", "attention", "other_ops", "python")


def op_shares(run: Callable[[], object], repeats: int = 5) -> dict[str, float]:
    """Shares (summing to 1) of run()'s profiled wall time: matmul, attention, other ops, python."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(repeats):
            run()
        wall_us = (time.perf_counter() - started) * 1e6
    totals = dict.fromkeys(KINDS, 0.0)
    for event in prof.key_averages():
        kind = "matmul" if event.key in MATMUL_OPS else "attention" if event.key in ATTENTION_OPS else "other_ops"
        totals[kind] += event.self_cpu_time_total
    totals["python"] = max(0.0, wall_us - sum(totals.values()))
    whole = sum(totals.values()) or 1.0
    return {kind: value / whole for kind, value in totals.items()}


def count_ops(run: Callable[[], object]) -> int:
    """ATen ops one run() dispatches (nested ones included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(event.count for event in prof.key_averages())



def memory_bandwidth_gb_s(megabytes: int = 256, repeats: int = 5) -> float:
    """This machine's copy bandwidth (bytes read plus written per second, best of `repeats`), in GB/s."""
    import time

    import torch

    src = torch.ones(megabytes * (1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page first
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes_per_forward(model, rows: int) -> int:
    """Bytes of weights one forward of `rows` tokens reads: packed int4 where that path runs, dense otherwise."""
    from stallfree.node_daemon.models.layers import Linear
    from stallfree.node_daemon.models.quantized import INT4_MAX_ROWS

    def dense(t) -> int:
        return t.numel() * t.element_size()

    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            int4 = module.int4 is not None and rows <= INT4_MAX_ROWS
            total += module.int4.nbytes if int4 else dense(module.weight)
    if model.lm_head is None:
        tied = model.tied_lm_head_int4
        total += tied.nbytes if tied is not None and rows <= INT4_MAX_ROWS else dense(model.embed_tokens.weight)
    return total
