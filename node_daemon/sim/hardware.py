"""Accelerator descriptions for the cost model: achieved matrix FLOP rate and HBM bandwidth, the knee
between them, fixed overhead, memory.

The cost model uses achieved figures, never datasheet peaks: no kernel reaches the peak. The GPU presets
are the vendors' datasheet figures (dense BF16 tensor-core rate, no sparsity; SXM parts) times the
efficiencies fitted to measured A100 kernel times (data/measured-linear-a100.csv, tests/calibration_fit.py):
the same efficiencies for every GPU, by their own datasheet figures. The fit also gives the knee: a
linear layer near the ridge point is slower than max(compute, memory), and the measured times follow
(compute^p + memory^p)^(1/p) with p about 2.

Figures given by hand (`--tflops`, `--hbm-tbps`, the textbook preset) are taken as the achieved figures
they state, with the plain max roofline (knee inf): no efficiency and no knee on top, so hand arithmetic
checks them. The per-iteration overhead (scheduling, input preparation, launches, sampling) is not on
any datasheet: the presets carry an estimate, and every figure can be overridden.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Hardware:
    name: str
    tflops: float  # achieved dense matrix FLOP rate at the model's dtype, 1e12 FLOP/s
    hbm_tbps: float  # achieved HBM bandwidth, 1e12 bytes/s
    overhead_ms: float  # fixed cost of every iteration, whatever its batch
    memory_gib: float  # device memory (sizes the KV cache in simulations)
    knee: float = math.inf  # p of the linear layers' (compute^p + memory^p)^(1/p); inf: max(compute, memory)
    peak_tflops: float | None = None  # the datasheet figures the achieved ones were derived from (None: given)
    peak_hbm_tbps: float | None = None

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12

    @property
    def bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12


@dataclass(frozen=True)
class Efficiency:
    """Achieved over datasheet figures, and the knee, as fitted to measured kernel times."""

    matmul: float  # achieved / peak dense matrix FLOP rate
    bandwidth: float  # achieved / peak HBM bandwidth
    knee: float
    source: str


# Fitted to the A100's measured non-attention layer times of Llama-3-8B and Llama-2-7B (1 to 16,384
# tokens): least squares of log(predicted / measured), three parameters. tests/test_calibration.py
# re-runs the fit from the data file and holds these figures and the residuals (all within 7%).
A100_LINEAR_FIT = Efficiency(matmul=0.655, bandwidth=0.682, knee=2.14,
                             source="fit to data/measured-linear-a100.csv (Vidur's A100 profiles)")

# Overhead estimate shared by the GPU presets: a CUDA-graph decode step of a 7-8B model spends roughly
# 1-2 ms outside the weight read (CPU scheduling, input copies, sampling).
_GPU_OVERHEAD_MS = 1.5


def calibrated(name: str, peak_tflops: float, peak_hbm_tbps: float, memory_gib: float,
               efficiency: Efficiency = A100_LINEAR_FIT, overhead_ms: float = _GPU_OVERHEAD_MS) -> Hardware:
    """A GPU from its datasheet figures and the fitted efficiencies."""
    return Hardware(name, tflops=peak_tflops * efficiency.matmul, hbm_tbps=peak_hbm_tbps * efficiency.bandwidth,
                    overhead_ms=overhead_ms, memory_gib=memory_gib, knee=efficiency.knee,
                    peak_tflops=peak_tflops, peak_hbm_tbps=peak_hbm_tbps)


HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 SXM4 80GB: 312 TFLOP/s BF16 dense, 2,039 GB/s HBM2e.
    "a100": calibrated("a100", 312.0, 2.039, 80.0),
    # NVIDIA H100 SXM5 80GB: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3.
    "h100": calibrated("h100", 989.0, 3.35, 80.0),
    # NVIDIA H200 SXM 141GB: same compute as H100, 4.8 TB/s HBM3e.
    "h200": calibrated("h200", 989.0, 4.8, 141.0),
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
    return with_figures(hardware, tflops=tflops, hbm_tbps=hbm_tbps, overhead_ms=overhead_ms, memory_gib=memory_gib)


def with_figures(hardware: Hardware, tflops: float | None = None, hbm_tbps: float | None = None,
                 overhead_ms: float | None = None, memory_gib: float | None = None) -> Hardware:
    """`hardware` with figures given by hand. A FLOP rate or bandwidth given is the achieved figure, and the
    roofline becomes the plain max (the fitted knee describes the preset's measured kernels, not these)."""
    changes: dict[str, float] = {
        key: value
        for key, value in (("tflops", tflops), ("hbm_tbps", hbm_tbps), ("overhead_ms", overhead_ms),
                           ("memory_gib", memory_gib))
        if value is not None
    }
    for key, value in changes.items():
        if value < 0 or (key != "overhead_ms" and value == 0):
            raise ValueError(f"{key} must be {'>= 0' if key == 'overhead_ms' else 'positive'}, got {value}")
    if not changes:
        return hardware
    if tflops is not None or hbm_tbps is not None:
        changes["knee"] = math.inf
    return replace(hardware, name=hardware.name.rstrip("*") + "*", **changes)
