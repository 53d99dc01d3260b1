"""Accelerator descriptions for the cost model: matrix FLOP rate, HBM bandwidth, fixed overhead, memory.

FLOP rates and bandwidths are the vendors' datasheet figures (dense BF16 tensor-core rate, no sparsity;
SXM parts). The per-iteration overhead (scheduling, input preparation, kernel launches, sampling) is
not on any datasheet: the presets carry an estimate, and every figure can be overridden.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Hardware:
    name: str
    tflops: float  # dense matrix FLOP rate at the model's dtype, 1e12 FLOP/s
    hbm_tbps: float  # HBM bandwidth, 1e12 bytes/s
    overhead_ms: float  # fixed cost of every iteration, whatever its batch
    memory_gib: float  # device memory (sizes the KV cache in simulations)

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12

    @property
    def bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12

    @property
    def ridge_flop_per_byte(self) -> float:
        """Arithmetic intensity above which a kernel is compute-bound on this device."""
        return self.flops_per_s / self.bytes_per_s


# Overhead estimate shared by the GPU presets: a CUDA-graph decode step of a 7-8B model spends roughly
# 1-2 ms outside the weight read (CPU scheduling, input copies, sampling).
_GPU_OVERHEAD_MS = 1.5

HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 SXM4 80GB: 312 TFLOP/s BF16 dense, 2,039 GB/s HBM2e.
    "a100": Hardware("a100", tflops=312.0, hbm_tbps=2.039, overhead_ms=_GPU_OVERHEAD_MS, memory_gib=80.0),
    # NVIDIA H100 SXM5 80GB: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3.
    "h100": Hardware("h100", tflops=989.0, hbm_tbps=3.35, overhead_ms=_GPU_OVERHEAD_MS, memory_gib=80.0),
    # NVIDIA H200 SXM 141GB: same compute as H100, 4.8 TB/s HBM3e.
    "h200": Hardware("h200", tflops=989.0, hbm_tbps=4.8, overhead_ms=_GPU_OVERHEAD_MS, memory_gib=141.0),
    # The round figures of the textbook stall example (no overhead), so its arithmetic can be checked by hand.
    "textbook": Hardware("textbook", tflops=400.0, hbm_tbps=3.0, overhead_ms=0.0, memory_gib=80.0),
}


def get_hardware(
    name: str,
    tflops: float | None = None,
    hbm_tbps: float | None = None,
    overhead_ms: float | None = None,
    memory_gib: float | None = None,
) -> Hardware:
    """A preset by name with any figure overridden (its name then ends in '*'); ValueError names bad input."""
    try:
        hardware = HARDWARE[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(sorted(HARDWARE))}") from None
    changes = {
        key: value
        for key, value in (("tflops", tflops), ("hbm_tbps", hbm_tbps), ("overhead_ms", overhead_ms),
                           ("memory_gib", memory_gib))
        if value is not None
    }
    for key, value in changes.items():
        if value < 0 or (key != "overhead_ms" and value == 0):
            raise ValueError(f"{key} must be {'>= 0' if key == 'overhead_ms' else 'positive'}, got {value}")
    return replace(hardware, name=f"{hardware.name}*", **changes) if changes else hardware
