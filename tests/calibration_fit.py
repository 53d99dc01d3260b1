"""Fit the cost model's achieved efficiencies and knee to measured linear-layer times.

The data (node_daemon/sim/data/measured-linear-a100.csv) is one decoder layer's non-attention time (norms, QKV and
output projections, RoPE, gated MLP, residual add) against tokens per forward pass, for two models on
an A100. The cost model predicts the same quantity as

    t(n) = (compute(n)^p + memory^p)^(1/p),  compute(n) = 2 x layer params x n / (e_f x peak FLOP rate),
                                             memory = layer weight bytes / (e_b x peak bandwidth)

The fit finds e_f (matrix FLOP efficiency), e_b (bandwidth efficiency) and p (the knee) by least
squares of log(predicted / measured) over every point of both models (Gauss-Newton with a damped step:
three smooth parameters, a dozen steps). The elementwise work (norms, RoPE, activation, residual)
scales with the tokens like the FLOPs do, so e_f absorbs it: it is the achieved rate of the whole
layer's non-attention work, not of a lone GEMM. An extra per-layer fixed cost can be fitted too
(`fixed_cost=True`); on this data it comes out at zero, so the presets carry none. tests/test_calibration.py
runs it and holds the presets (node_daemon/sim/hardware.py) to what it finds.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stallfree.shapes import ModelShape, get_shape
from stallfree.node_daemon import sim
from stallfree.node_daemon.sim.cost_model import RooflineCostModel
from stallfree.node_daemon.sim.hardware import Efficiency, Hardware, calibrated

DATA_DIR = Path(sim.__file__).with_name("data")
LINEAR_A100_CSV = DATA_DIR / "measured-linear-a100.csv"

# The measured models' shapes (Llama-2-7B is not a serving preset, so it lives here).
LLAMA_2_7B = ModelShape("llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                        num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096)
MEASURED_SHAPES: dict[str, ModelShape] = {"llama-3-8b": get_shape("llama-3-8b"), "llama-2-7b": LLAMA_2_7B}

# Datasheet figures of the measured device (A100 SXM4 80GB, bf16 dense).
A100_PEAK_TFLOPS, A100_PEAK_HBM_TBPS = 312.0, 2.039


@dataclass(frozen=True)
class Measurement:
    gpu: str
    model: str
    num_tokens: int
    per_layer_ms: float


@dataclass(frozen=True)
class LinearFit:
    efficiency: Efficiency
    fixed_ms: float  # per-layer fixed cost (0 unless fitted)
    residuals: list[tuple[str, int, float, float]]  # (model, tokens, measured ms, predicted ms)

    @property
    def max_abs_error(self) -> float:
        return max(abs(pred / meas - 1) for _, _, meas, pred in self.residuals)

    @property
    def rms_error(self) -> float:
        return math.sqrt(sum((pred / meas - 1) ** 2 for _, _, meas, pred in self.residuals) / len(self.residuals))


def load_measurements(path: str | Path = LINEAR_A100_CSV) -> list[Measurement]:
    """The data file's rows ('#' lines are its header notes)."""
    lines = [line for line in Path(path).read_text().splitlines() if line and not line.startswith("#")]
    return [Measurement(row["gpu"], row["model"], int(row["num_tokens"]), float(row["per_layer_ms"]))
            for row in csv.DictReader(lines)]


def preset_layer_ms(hardware: Hardware, model: str, num_tokens: int, fixed_ms: float = 0.0) -> float:
    """What the cost model predicts for one measured point on `hardware`."""
    return RooflineCostModel(MEASURED_SHAPES[model], hardware).layer_linear_ms(num_tokens) + fixed_ms


def fit_linear(measurements: list[Measurement], peak_tflops: float = A100_PEAK_TFLOPS,
               peak_hbm_tbps: float = A100_PEAK_HBM_TBPS, fixed_cost: bool = False,
               steps: int = 100) -> LinearFit:
    """Least squares of log(predicted / measured) over (e_f, e_b, p[, fixed ms]); see the module docstring."""
    # The cost model's own per-layer figures (bf16): what the fitted efficiencies will be applied to.
    models = {name: RooflineCostModel(shape, Hardware("peak", peak_tflops, peak_hbm_tbps, 0.0, 80.0))
              for name, shape in MEASURED_SHAPES.items()}
    flops = np.array([2.0 * models[m.model].matmul_params_per_token / MEASURED_SHAPES[m.model].num_layers
                      * m.num_tokens for m in measurements])
    weight_bytes = np.array([float(models[m.model].layer_weight_bytes) for m in measurements])
    measured = np.array([m.per_layer_ms for m in measurements])
    peak_f, peak_b = peak_tflops * 1e12, peak_hbm_tbps * 1e12

    def log_residuals(x: np.ndarray) -> np.ndarray:
        e_f, e_b, p = x[0], x[1], x[2]
        compute = flops / (e_f * peak_f) * 1e3
        memory = weight_bytes / (e_b * peak_b) * 1e3
        predicted = (compute ** p + memory ** p) ** (1.0 / p) + (x[3] if fixed_cost else 0.0)
        return np.log(predicted / measured)

    x = np.array([0.7, 0.7, 2.0] + ([0.01] if fixed_cost else []))
    damping = 1e-3
    cost = float(np.sum(log_residuals(x) ** 2))
    for _ in range(steps):
        r = log_residuals(x)
        jacobian = np.empty((len(r), len(x)))
        for i in range(len(x)):  # central differences: the parameters are O(1) (ms for the fixed cost)
            h = 1e-6 * max(1.0, abs(x[i]))
            up, down = x.copy(), x.copy()
            up[i] += h
            down[i] -= h
            jacobian[:, i] = (log_residuals(up) - log_residuals(down)) / (2 * h)
        normal = jacobian.T @ jacobian
        step = np.linalg.solve(normal + damping * np.diag(np.diag(normal)), -jacobian.T @ r)
        trial = x + step
        trial_cost = float(np.sum(log_residuals(trial) ** 2)) if _valid(trial, fixed_cost) else math.inf
        if trial_cost < cost:
            x, cost, damping = trial, trial_cost, max(damping / 3, 1e-9)
            if np.max(np.abs(step)) < 1e-10:
                break
        else:
            damping *= 10
    efficiency = Efficiency(matmul=float(x[0]), bandwidth=float(x[1]), knee=float(x[2]),
                            source=f"least-squares fit to {len(measurements)} measured points")
    fixed_ms = float(x[3]) if fixed_cost else 0.0
    hardware = calibrated("fit", peak_tflops, peak_hbm_tbps, 80.0, efficiency)
    residuals = [(m.model, m.num_tokens, m.per_layer_ms, preset_layer_ms(hardware, m.model, m.num_tokens, fixed_ms))
                 for m in measurements]
    return LinearFit(efficiency, fixed_ms, residuals)


def residuals_on(hardware: Hardware, measurements: list[Measurement]) -> list[tuple[str, int, float, float]]:
    """(model, tokens, measured ms, predicted ms) of every point on a preset."""
    return [(m.model, m.num_tokens, m.per_layer_ms, preset_layer_ms(hardware, m.model, m.num_tokens))
            for m in measurements]


def _valid(x: np.ndarray, fixed_cost: bool) -> bool:
    return bool(x[0] > 0 and x[1] > 0 and x[2] >= 1 and (not fixed_cost or x[3] > -1.0))

