"""The GPU presets calibrated to measured kernel times: the fit's method, its residuals, the presets it makes.

The data (node_daemon/sim/data/measured-linear-a100.csv, from the Vidur simulator's public A100 profiles)
is one decoder layer's non-attention time of Llama-3-8B and Llama-2-7B against tokens per forward pass.
The fit (calibration_fit.fit_linear: least squares of log(predicted / measured) over matrix-FLOP efficiency,
bandwidth efficiency and the knee) is re-run here from the file, so the preset figures cannot drift
from the data they claim to come from.
"""
from __future__ import annotations

import math

import pytest

from stallfree.node_daemon.sim.cost_model import RooflineCostModel
from stallfree.node_daemon.sim.hardware import A100_LINEAR_FIT, HARDWARE, get_hardware
from stallfree.shapes import get_shape

from calibration_fit import (
    A100_PEAK_HBM_TBPS, A100_PEAK_TFLOPS, MEASURED_SHAPES, fit_linear, load_measurements, residuals_on,
)


@pytest.fixture(scope="module")
def measurements():
    return load_measurements()


def _table(residuals) -> str:
    return "\n".join(f"{model:<11}{tokens:>7}{meas:>10.4f}{pred:>10.4f}{(pred / meas - 1) * 100:>+8.1f}%"
                     for model, tokens, meas, pred in residuals)


def test_the_data_covers_both_models_from_1_to_16k_tokens(measurements):
    by_model = {m: sorted(x.num_tokens for x in measurements if x.model == m) for m in MEASURED_SHAPES}
    assert by_model["llama-3-8b"] == [1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert by_model["llama-2-7b"][0] == 1 and by_model["llama-2-7b"][-1] == 4096
    assert {x.gpu for x in measurements} == {"a100"}


def test_the_fit_reproduces_the_preset_efficiencies(measurements):
    fit = fit_linear(measurements)
    # The preset keeps the fit rounded to three figures.
    assert fit.efficiency.matmul == pytest.approx(A100_LINEAR_FIT.matmul, abs=6e-4)
    assert fit.efficiency.bandwidth == pytest.approx(A100_LINEAR_FIT.bandwidth, abs=6e-4)
    assert fit.efficiency.knee == pytest.approx(A100_LINEAR_FIT.knee, abs=6e-3)
    # Residuals of the fit itself: every point within 7%, 3.1% root mean square.
    assert fit.max_abs_error < 0.07 and fit.rms_error < 0.031, _table(fit.residuals)


def test_the_data_shows_no_per_layer_fixed_cost(measurements):
    plain = fit_linear(measurements)
    with_fixed = fit_linear(measurements, fixed_cost=True)
    # A fitted fixed cost comes out negative (no physical cost) and buys almost nothing.
    assert with_fixed.fixed_ms < 0.0
    assert plain.rms_error - with_fixed.rms_error < 0.002


def test_the_knee_is_needed_a_plain_max_roofline_misses_the_ridge(measurements):
    # With the fitted efficiencies but max(compute, memory), the ridge region (128 tokens) is 24% fast.
    hard = get_hardware("a100", tflops=HARDWARE["a100"].tflops, hbm_tbps=HARDWARE["a100"].hbm_tbps)
    assert math.isinf(hard.knee)
    worst = min(pred / meas - 1 for _, _, meas, pred in residuals_on(hard, measurements))
    assert worst < -0.2


def test_a100_preset_predicts_every_measured_point_within_10_percent(measurements):
    residuals = residuals_on(HARDWARE["a100"], measurements)
    print("\nmodel       tokens  measured predicted  error\n" + _table(residuals))
    assert len(residuals) == 22
    for model, tokens, measured, predicted in residuals:
        assert abs(predicted / measured - 1) < 0.10, f"{model} at {tokens} tokens"
    # The same figures through the whole cost model: 32 layers of a 16K-token prefill.
    cost = RooflineCostModel(get_shape("llama-3-8b"), HARDWARE["a100"])
    assert 32 * cost.layer_linear_ms(16384) == pytest.approx(32 * 34.409, rel=0.10)


def test_other_gpus_take_the_same_efficiencies_by_their_datasheet_figures():
    for name, peak_tflops, peak_tbps in (("a100", A100_PEAK_TFLOPS, A100_PEAK_HBM_TBPS), ("h100", 989.0, 3.35),
                                         ("h200", 989.0, 4.8)):
        hw = HARDWARE[name]
        assert (hw.peak_tflops, hw.peak_hbm_tbps) == (peak_tflops, peak_tbps)
        assert hw.tflops == pytest.approx(peak_tflops * A100_LINEAR_FIT.matmul)
        assert hw.hbm_tbps == pytest.approx(peak_tbps * A100_LINEAR_FIT.bandwidth)
        assert hw.knee == A100_LINEAR_FIT.knee


def test_figures_given_by_hand_are_the_achieved_ones_with_the_plain_roofline():
    hw = get_hardware("a100", tflops=400, hbm_tbps=3)
    assert (hw.tflops, hw.hbm_tbps, hw.name) == (400, 3, "a100*") and math.isinf(hw.knee)
    textbook = HARDWARE["textbook"]
    assert (textbook.tflops, textbook.hbm_tbps, textbook.overhead_ms) == (400.0, 3.0, 0.0)
    assert math.isinf(textbook.knee) and textbook.peak_tflops is None
    # Changing only the overhead keeps the calibration.
    assert get_hardware("a100", overhead_ms=0).knee == A100_LINEAR_FIT.knee
