"""The cost model pinned to arithmetic done by hand, and the profile-interpolating variant."""
from __future__ import annotations

import pytest

from stallfree.contracts import Profile, ProfilePoint
from stallfree.shapes import get_shape
from stallfree.node_daemon.sim.cost_model import ProfileCostModel, RooflineCostModel
from stallfree.node_daemon.sim.hardware import HARDWARE, get_hardware
from stallfree.profile_rules import budget_for_tpot

# Llama-3-8B's figures, written out so the test does not trust the code it checks.
H, I, L, HEADS, KV_HEADS, D, VOCAB = 4096, 14336, 32, 32, 8, 128, 128256
MATMUL_PARAMS = L * (H * HEADS * D + 2 * H * KV_HEADS * D + HEADS * D * H + 3 * H * I)
# Everything read each step: layers (with their two norms), the final norm and the untied LM head.
WEIGHT_BYTES = 2 * (MATMUL_PARAMS + L * 2 * H + H + VOCAB * H)
KV_BYTES_PER_TOKEN = 2 * L * KV_HEADS * D * 2
FLOPS, BW = 400e12, 3e12


@pytest.fixture
def model() -> RooflineCostModel:
    hw = get_hardware("h100", tflops=400, hbm_tbps=3, overhead_ms=1.25)
    return RooflineCostModel(get_shape("llama-3-8b"), hw, weight_dtype_bytes=2)


def test_pure_decode_is_weight_plus_kv_bytes_over_bandwidth_plus_overhead(model):
    contexts = [1024] * 48 + [3000] * 16
    expected_s = (WEIGHT_BYTES + sum(contexts) * KV_BYTES_PER_TOKEN) / BW
    assert model.predict_ms(contexts, []) == pytest.approx(expected_s * 1000 + 1.25, rel=1e-9)


def test_large_prefill_is_two_params_tokens_over_flop_rate_plus_attention(model):
    n = 8192
    linear_flops = 2 * MATMUL_PARAMS * n + 2 * VOCAB * H  # logits for the last position only
    attention_flops = 4 * HEADS * D * L * (n * (n + 1) // 2)  # causal: query i sees i + 1 keys
    expected_ms = (linear_flops + attention_flops) / FLOPS * 1000 + 1.25
    assert model.predict_ms([], [(0, n)]) == pytest.approx(expected_ms, rel=1e-9)
    # The textbook shortcut (2 x parameters x tokens) is within the attention term of it.
    assert 2 * MATMUL_PARAMS * n / FLOPS * 1000 < expected_ms < 1.2 * 2 * MATMUL_PARAMS * n / FLOPS * 1000 + 1.25


def test_chunk_attends_to_its_prefix_and_rereads_its_kv(model):
    prefix, n = 6000, 512
    pairs = n * prefix + n * (n + 1) // 2
    linear_s = (2 * MATMUL_PARAMS * n + 2 * VOCAB * H) / FLOPS  # compute-bound at 512 tokens
    attention_s = max(4 * HEADS * D * L * pairs / FLOPS, (prefix + n) * KV_BYTES_PER_TOKEN / BW)
    assert model.predict_ms([], [(prefix, n)]) == pytest.approx((linear_s + attention_s) * 1000 + 1.25, rel=1e-9)
    # A one-token chunk at the end of a prefix is a decode: same keys, same KV bytes.
    assert model.predict_ms([], [(1023, 1)]) == pytest.approx(model.predict_ms([1024], []), rel=1e-12)


def test_chunking_keeps_attention_flops_but_pays_rereads_and_per_iteration_costs(model):
    n, chunk = 8192, 512
    chunks = [(start, chunk) for start in range(0, n, chunk)]
    pairs = sum(c * p + c * (c + 1) // 2 for p, c in chunks)
    assert pairs == n * (n + 1) // 2  # chunking creates no attention FLOPs
    kv_read = sum(p + c for p, c in chunks)
    assert kv_read > 8 * n  # but earlier chunks' KV is read again by every later chunk
    chunked = sum(model.predict_ms([], [c]) for c in chunks)
    assert chunked > model.predict_ms([], [(0, n)]) + (len(chunks) - 1) * 1.25


def test_breakdown_matches_prediction(model):
    batch = ([700] * 30, [(100, 300), (0, 50)])
    parts = model.breakdown(*batch)
    assert parts.total_ms == pytest.approx(model.predict_ms(*batch), rel=1e-12)
    assert parts.weight_read_ms == pytest.approx(WEIGHT_BYTES / BW * 1000)


def test_the_knee_softens_the_linear_roofline_where_compute_meets_memory():
    shape = get_shape("llama-3-8b")
    soft = RooflineCostModel(shape, get_hardware("a100"))
    hard = RooflineCostModel(shape, get_hardware("a100", tflops=soft.hardware.tflops, hbm_tbps=soft.hardware.hbm_tbps))
    p = soft.hardware.knee
    for tokens in (1, 64, 300, 1000, 8192):
        parts = soft.breakdown([], [(0, tokens)])
        expected = (parts.linear_compute_ms ** p + parts.weight_read_ms ** p) ** (1 / p)
        assert parts.linear_ms == pytest.approx(expected, rel=1e-12)
        assert soft.predict_ms([], [(0, tokens)]) == pytest.approx(parts.total_ms, rel=1e-12)
        hard_parts = hard.breakdown([], [(0, tokens)])
        assert hard_parts.linear_ms == max(hard_parts.linear_compute_ms, hard_parts.weight_read_ms)
        assert parts.linear_ms > hard_parts.linear_ms  # never faster than either bound
    # Far from the ridge the two agree (within 2%): weight-bound decode, compute-bound long prefill.
    assert soft.breakdown([1000], []).linear_ms == pytest.approx(hard.breakdown([1000], []).linear_ms, rel=0.02)
    assert soft.breakdown([], [(0, 8192)]).linear_ms == pytest.approx(
        hard.breakdown([], [(0, 8192)]).linear_ms, rel=0.02)


def test_empty_batch_costs_nothing(model):
    assert model.predict_ms([], []) == 0.0


def test_tied_embeddings_are_read_once_as_the_lm_head():
    shape = get_shape("smollm2-135m")
    cost = RooflineCostModel(shape, get_hardware("a100"))
    assert cost.weight_bytes == 2 * shape.num_parameters


def test_presets_carry_datasheet_figures_and_overrides():
    assert (HARDWARE["a100"].peak_tflops, HARDWARE["a100"].peak_hbm_tbps) == (312.0, 2.039)
    assert (HARDWARE["h100"].peak_tflops, HARDWARE["h100"].peak_hbm_tbps) == (989.0, 3.35)
    assert (HARDWARE["h200"].peak_hbm_tbps, HARDWARE["h200"].memory_gib) == (4.8, 141.0)
    hw = get_hardware("H100", tflops=500, overhead_ms=0)
    assert (hw.tflops, hw.hbm_tbps, hw.overhead_ms) == (500, HARDWARE["h100"].hbm_tbps, 0)
    with pytest.raises(ValueError, match="unknown hardware preset 'tpu'"):
        get_hardware("tpu")
    with pytest.raises(ValueError, match="hbm_tbps must be positive"):
        get_hardware("a100", hbm_tbps=0)


def test_profile_cost_model_interpolates_the_measured_curve():
    profile = Profile(
        device="test",
        decode_only=[ProfilePoint(1, 1, 5.0), ProfilePoint(64, 64, 8.0)],
        mixed=[ProfilePoint(128, 32, 10.0), ProfilePoint(512, 32, 20.0), ProfilePoint(1024, 32, 40.0)],
    )
    cost = ProfileCostModel(profile)
    assert cost.predict_ms([900] * 64, []) == pytest.approx(8.0)
    assert cost.predict_ms([900] * 32, []) == pytest.approx(5.0 + 3.0 * 31 / 63)
    assert cost.predict_ms([500] * 32, [(0, 288)]) == pytest.approx(15.0)  # 320 tokens: half way from 128 to 512
    assert cost.predict_ms([], [(0, 1024)]) == pytest.approx(40.0)
    with pytest.raises(ValueError, match="mixed point"):
        ProfileCostModel(Profile(device="x"))


def test_roofline_profile_round_trips_through_the_profile_model(model):
    profile = model.profile(max_tokens=2048, num_decodes=32, context_len=1024, max_num_seqs=64)
    again = ProfileCostModel(Profile.from_dict(profile.to_dict()))
    for point in profile.mixed:
        decodes = [1024] * point.num_decodes
        chunk = [(1024, point.tokens - point.num_decodes)]
        assert again.predict_ms(decodes, chunk) == pytest.approx(model.predict_ms(decodes, chunk))
    # Iteration time grows with tokens, so the profile rule picks a larger budget for a looser target.
    assert budget_for_tpot(profile, 40.0, lo=1, margin=1.0) > budget_for_tpot(profile, 20.0, lo=1, margin=1.0) >= 64
