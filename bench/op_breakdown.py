"""Where a forward's time goes by kind of op, from torch.profiler: weight matmuls, attention, the rest.

The profiler's self time of every ATen op is summed per kind; what no op accounts for is Python and
dispatch. The profiler slows small ops down, so the kinds are reported as shares, which the caller
applies to the forward's unprofiled time.
"""
from __future__ import annotations

from typing import Callable

# The weight-only int4/int8 kernels and dense GEMMs (the projections and the LM head).
MATMUL_OPS = {"aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "aten::mm", "aten::addmm",
              "aten::_weight_int4pack_mm"}
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

