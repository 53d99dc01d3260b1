"""The compiled code kernel (models/cpu_code_matmul.h) on GGUF block codes, on every x86 tier this CPU has
(AVX512-VNNI, AVX2, portable loops; the lower tiers forced on a bigger CPU, each from its own library): its layout
holds exactly the weights gguf dequantizes to, and its matmul (int16 activations, integer dot products) is the
float64 matmul of those weights within bfloat16's rounding of the output, on SmolLM2's own Q4_1 and Q8_0 tensors and
on Q4_0 blocks, for row counts on both sides of its row passes; every tier gives the same sums; a zero block,
wide-ranging activations and zero rows hold, and a weight of the wrong width is refused with a clear error.

Each tier's extension is compiled once per machine into the stallfree cache; without a C++ compiler these tests
skip, and a tier the CPU lacks skips with its instructions named."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from model_helpers import relative_error
from stallfree.node_daemon.models import cpu_decode
from stallfree.node_daemon.models.cpu_tier import TIERS, _NEEDS, detected_tier, resolve_tier
from stallfree.node_daemon.models.quantized import BlockCodes, TiledCodes, decode_blocks

# bfloat16 output rounding (2^-9 of a value) is the kernel's error: measured 0.0016-0.0017 here, int16 activations'
# rounding adding nothing visible. int8 activations measured 0.015-0.024 on the same tensors.
CODE_TOLERANCE = 4e-3
# float32 output: int16 activations' rounding alone (measured 1.1e-4 here), a tenth of bfloat16's 2^-9.
FLOAT_OUT_TOLERANCE = 3e-4
# Tiers whose kernels differ: AVX512-VNNI (the avx512_bf16 tier's library), AVX2 and the portable loops.
KERNEL_TIERS = ["avx512_bf16", "avx2", "generic"]


@functools.lru_cache(maxsize=None)
def _kernel(tier: str):
    if TIERS.index(tier) > TIERS.index(detected_tier()):
        pytest.skip(f"this CPU lacks the {tier} tier ({', '.join(_NEEDS[tier])})")
    kernels = cpu_decode.kernels_for(resolve_tier(tier))
    if kernels is None:
        pytest.skip("compiled extension unavailable (no C++ compiler, or the compile failed: see the log)")
    return kernels.code_matmul


@pytest.fixture(params=KERNEL_TIERS)
def tier(request) -> str:
    return request.param


@functools.lru_cache(maxsize=None)
def _codes(name: str) -> BlockCodes:
    import gguf

    from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path

    t = next(t for t in gguf.GGUFReader(embedded_gguf_path()).tensors if t.name == name)
    codes = decode_blocks(t.data, t.tensor_type.name, int(t.shape[1]), int(t.shape[0]))
    assert codes is not None
    return codes


def _q4_0(rows: int, cols: int, seed: int) -> BlockCodes:
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.01, 0.1, (rows, cols // 32)).astype(np.float16).astype(np.float32)
    return BlockCodes(rng.integers(0, 16, (rows, cols), dtype=np.uint8), d, np.zeros_like(d), 1, "Q4_0")


def _matmul(tier: str, weight: TiledCodes, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
    return _kernel(tier)(x, weight.blocks, weight.bits, float_out)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"])
def test_layout_holds_the_gguf_weights(name):
    codes = _codes(name)
    weight = TiledCodes.from_codes(codes)
    assert weight.bits == (8 if codes.qtype == "Q8_0" else 4)
    want = codes.dequantize()
    np.testing.assert_allclose(weight.dequantize().numpy(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 70])
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_gate.weight", "blk.7.ffn_down.weight",
                                  "token_embd.weight"])
def test_matmul_is_the_dequantized_one(tier, name, rows):
    codes = _codes(name)
    width = codes.codes.shape[1] // codes.planes
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = _matmul(tier, TiledCodes.from_codes(codes), x)
    want = x.double() @ torch.from_numpy(codes.dequantize()).double().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, codes.rows)
    assert relative_error(got, want) < CODE_TOLERANCE
    exact = _matmul(tier, TiledCodes.from_codes(codes), x, float_out=True)  # an LM head's logits: the float32 sums
    assert exact.dtype == torch.float32 and relative_error(exact, want) < FLOAT_OUT_TOLERANCE


def test_q4_0_blocks_with_a_zero_block_and_wide_ranging_rows(tier):
    codes = _q4_0(48, 128, seed=3)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    x[0, 32:64] = 0.0  # a block of zeros: its scale is 0, it adds nothing
    x[1] *= 1e4  # large and small rows: each block has its own scale
    x[2] *= 1e-4
    x = x.bfloat16()
    got = _matmul(tier, TiledCodes.from_codes(codes), x)
    want = x.double() @ torch.from_numpy(codes.dequantize()).double().T
    for r in range(4):
        assert relative_error(got[r], want[r]) < CODE_TOLERANCE


def test_no_rows_and_a_weight_of_the_wrong_width(tier):
    weight = TiledCodes.from_codes(_q4_0(16, 64, seed=4))
    assert _matmul(tier, weight, torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 16)
    with pytest.raises(RuntimeError, match="do not match x's width"):
        _matmul(tier, weight, torch.zeros(2, 96, dtype=torch.bfloat16))


def test_every_tier_gives_the_same_sums():
    """The tiers differ in instructions, not arithmetic: exact int32 sums a block, float32 across blocks in the
    same order (the VNNI and AVX2 kernels' fused multiply-adds round alike), so their float32 outputs agree to
    float32 rounding."""
    codes = _codes("blk.3.ffn_gate.weight")
    x = torch.randn(5, codes.codes.shape[1], generator=torch.Generator().manual_seed(9)).bfloat16()
    weight = TiledCodes.from_codes(codes)
    have = [t for t in KERNEL_TIERS if TIERS.index(t) <= TIERS.index(detected_tier())]
    outs = [_matmul(t, weight, x, float_out=True) for t in have]
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-5, atol=1e-4)


# int8 activations (a 254th of a block's largest value) against the float64 matmul: measured 0.007-0.015 on these
# tensors here, int16's 3e-5 (code_matmul's int8_min_rows; the compiled forward's many-row iterations take it).
INT8_TOLERANCE = 0.03


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"])
def test_int8_activations_from_their_row_limit_where_the_tier_has_them(tier, name):
    """From int8_min_rows rows the VNNI kernel takes int8 activations (VPDPBUSD: 4-bit and 8-bit tiles here, 5-bit
    in the next test) and the AVX2 one for 4- and 5-bit codes (VPMADDUBSW): the matmul of the same weights within
    int8's rounding; below the limit, for AVX2's 8-bit codes and on the portable tier at any row count, the int16
    sums bit for bit."""
    kernels = cpu_decode.ops(resolve_tier(tier)) if _kernel(tier) else None
    codes = _codes(name)
    weight = TiledCodes.from_codes(codes)
    width = codes.codes.shape[1] // codes.planes
    want_weights = torch.from_numpy(codes.dequantize()).double().T
    for rows in (3, 16, 21):
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).bfloat16()
        int16 = kernels.code_matmul(x, weight.blocks, weight.bits, True)
        int8 = kernels.code_matmul(x, weight.blocks, weight.bits, True, 9)
        takes_int8 = tier == "avx512_bf16" or (tier == "avx2" and weight.bits != 8)
        if takes_int8 and rows >= 9:
            assert not torch.equal(int8, int16)
            assert relative_error(int8, x.double() @ want_weights) < INT8_TOLERANCE
        else:
            assert torch.equal(int8, int16)
    assert kernels.int8_kernel() == (tier != "generic")


@pytest.mark.parametrize("int8_tier", ["avx512_bf16", "avx2"])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q8_0"])
def test_int8_sums_of_a_row_do_not_depend_on_the_rows_beside_it(int8_tier, qtype):
    """A pass over a tile serves several rows (8 on VNNI, 4 on AVX2) from the same codes: each row's sums are its
    own, bit for bit, whichever pass and place in it the row lands in."""
    kernels = cpu_decode.ops(resolve_tier(int8_tier)) if _kernel(int8_tier) else None
    raw, _ = _gguf_blocks(qtype, 32, 256, seed=5)
    weight = TiledCodes.from_codes(decode_blocks(raw, qtype, 32, 256))
    if not kernels.int8_kernel() or (int8_tier == "avx2" and weight.bits == 8):
        pytest.skip("no int8 body for these codes on this tier")
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    whole = kernels.code_matmul(x, weight.blocks, weight.bits, True, 1)
    for begin, end in ((0, 1), (3, 12), (9, 25), (17, 40)):
        assert torch.equal(kernels.code_matmul(x[begin:end], weight.blocks, weight.bits, True, 1), whole[begin:end])


@pytest.mark.parametrize("int8_tier", ["avx512_bf16", "avx2"])
def test_int8_activations_on_five_bit_codes_with_zeros_and_wide_ranging_rows(int8_tier):
    """5-bit tiles (the fifth bits added on bytes) with zeros (Q5_1's offsets), a zero block and rows of very
    different sizes: each block keeps its own int8 scale."""
    kernels = cpu_decode.ops(resolve_tier(int8_tier)) if _kernel(int8_tier) else None
    raw, want = _gguf_blocks("Q5_1", 48, 512, seed=21)
    weight = TiledCodes.from_codes(decode_blocks(raw, "Q5_1", 48, 512))
    assert weight.bits == 5 and weight.has_zeros
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(4))
    x[0, 64:96] = 0.0
    x[1] *= 1e4
    x[2] *= 1e-4
    x = x.bfloat16()
    got = kernels.code_matmul(x, weight.blocks, weight.bits, True, 1)
    exact = x.double() @ torch.from_numpy(want).double().T
    for r in range(12):
        assert relative_error(got[r], exact[r]) < INT8_TOLERANCE


def _gguf_blocks(qtype: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(block bytes [rows, bytes per row], gguf's own dequantization [rows, cols]) of random weights: quantized by
    gguf where it can (Q4_0 .. Q8_0), else random codes under sane float16 scales (IQ4_NL, IQ4_XS)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from stallfree.node_daemon.models.small_block_codes import BLOCK_BYTES, BLOCK_WEIGHTS

    kind = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    if not qtype.startswith("IQ"):
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), kind).reshape(rows, -1)
    else:
        raw = rng.integers(0, 256, (rows, cols // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]), dtype=np.uint8)
        blocks = raw.reshape(rows, -1, BLOCK_BYTES[qtype])
        d = rng.uniform(0.001, 0.01, blocks.shape[:2]).astype(np.float16)
        blocks[..., 0:2] = d.view(np.uint8).reshape(*d.shape, 2)
    return raw, dequantize(raw, kind).reshape(rows, cols)


@pytest.mark.parametrize("qtype,bits", [("Q5_0", 5), ("Q5_1", 5), ("IQ4_NL", 8), ("IQ4_XS", 8)])
def test_q5_and_iq4_blocks_are_served_from_their_codes(tier, qtype, bits):
    """Gemma 3's and other Q4_K_M files' fallbacks (Q5_0, Q5_1; rows not a multiple of 256) and the IQ4 types: their
    codes exactly as gguf dequantizes them (IQ4_XS within the float16 rounding of its scale d * (ls - 32)), 5-bit tiles
    for the 5-bit types, and the matmul of those weights."""
    raw, want = _gguf_blocks(qtype, 48, 512, seed=len(qtype))
    codes = decode_blocks(raw, qtype, 48, 512)
    np.testing.assert_array_equal(codes.dequantize(), want)
    weight = TiledCodes.from_codes(codes)
    assert weight.bits == bits
    np.testing.assert_allclose(weight.dequantize().numpy(), want, rtol=2 ** -10, atol=1e-7)
    for rows in (1, 5, 11):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
        exact = _matmul(tier, weight, x, float_out=True)
        assert relative_error(exact, x.double() @ weight.dequantize().double().T) < FLOAT_OUT_TOLERANCE


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K"])
def test_two_and_three_bit_k_quants_take_the_code_kernel(tier, qtype):
    """Q2_K and Q3_K (the bulk of Q2_K and Q3_K_M files) as 8-bit tiles (Q3_K exact and without zeros, Q2_K
    re-coded: tests/test_kquants.py): the kernel's matmul is the matmul of the tiles' weights."""
    from stallfree.bench.gguf_blocks import random_blocks

    raw = random_blocks(qtype, 48, 512, np.random.default_rng(len(qtype)))
    weight = TiledCodes.from_codes(decode_blocks(raw, qtype, 48, 512))
    assert weight.bits == 8 and weight.has_zeros == (qtype == "Q2_K")
    for rows in (1, 5, 11):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
        exact = _matmul(tier, weight, x, float_out=True)
        assert relative_error(exact, x.double() @ weight.dequantize().double().T) < FLOAT_OUT_TOLERANCE


@pytest.mark.parametrize("qtype,zeros", [("Q4_0", False), ("Q5_0", False), ("Q8_0", False), ("IQ4_NL", False),
                                         ("Q4_1", True), ("Q5_1", True)])
def test_symmetric_types_keep_the_files_bytes(qtype, zeros):
    """A symmetric type's zeros follow from its scales (-2^(bits-1) scale): its tiles hold none, so they take the
    file's own bytes (Q8_0: 34 a block of 32 weights); the affine types (mins) keep theirs."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        from gguf.quants import quantize

        rng = np.random.default_rng(7)
        raw = quantize(rng.standard_normal((32, 256)).astype(np.float32), GGMLQuantizationType[qtype]).reshape(32, -1)
    else:
        raw, _ = _gguf_blocks(qtype, 32, 256, seed=7)
    weight = TiledCodes.from_codes(decode_blocks(raw, qtype, 32, 256))
    assert weight.has_zeros == zeros
    if not zeros and qtype != "IQ4_NL":  # IQ4's non-linear levels take 8-bit codes: more bytes than its 4.5 bits
        assert weight.nbytes == raw.nbytes
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = x.double() @ weight.dequantize().double().T
    assert relative_error(_matmul("generic", weight, x, float_out=True), want) < FLOAT_OUT_TOLERANCE


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q3_K"])
def test_records_of_the_files_integers_on_every_tier(tier, qtype):
    """Q4_K/Q5_K super-block records (the file's integer sub-block scales under each super-block's float16 d and
    dmin) and Q6_K's 6-bit and Q3_K's 3-bit records (their codes, two int8 scales a block under d): the matmul of
    gguf's dequantized weights within int16's rounding below the int8 limit and int8's above it, each row's sums its
    own whatever rows pass beside it, and code_dequantize and code_rows give the weights rounded once to bfloat16,
    bit for bit. 6- and 3-bit records run on AVX512-VNNI; the other tiers' kernels refuse them by name (their
    tilers never make them), and look their rows up all the same."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from stallfree.node_daemon.models.gguf_tiles import GgufBlocks
    from stallfree.bench.gguf_blocks import random_blocks
    from stallfree.node_daemon.models.kquant_tiles import halves_tiles, super_tiles
    from test_kquants import _random_k_blocks

    ops = _dequantize_op(tier)
    rows, cols = 48, 512
    raw = _random_k_blocks(qtype, rows, cols, seed=9) if qtype != "Q3_K" else \
        random_blocks(qtype, rows, cols, np.random.default_rng(9))
    parts = [(slice(0, rows), GgufBlocks(raw, qtype, cols))]
    halves = qtype in ("Q6_K", "Q3_K")
    weight = halves_tiles(parts, rows, cols) if halves else super_tiles(parts, rows)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols)).double()
    np.testing.assert_array_equal(weight.dequantize().numpy(), want.float().numpy())
    ids = torch.tensor([0, 17, 47])
    torch.testing.assert_close(ops.code_rows(weight.blocks, ids), want[ids].bfloat16(), rtol=0, atol=0)
    x = torch.randn(21, cols, generator=torch.Generator().manual_seed(9)).bfloat16()
    if halves and not resolve_tier(tier).vnni:
        with pytest.raises(RuntimeError, match="AVX512-VNNI only"):
            ops.code_matmul(x, weight.blocks, weight.bits, True)
        return
    for count in (1, 2, 3, 5, 11, 21):
        exact = ops.code_matmul(x[:count], weight.blocks, weight.bits, True)
        assert relative_error(exact, x[:count].double() @ want.T) < FLOAT_OUT_TOLERANCE
        int8 = ops.code_matmul(x[:count], weight.blocks, weight.bits, True, 9)
        tolerance = INT8_TOLERANCE if count >= 9 else FLOAT_OUT_TOLERANCE
        assert relative_error(int8, x[:count].double() @ want.T) < tolerance
    whole = ops.code_matmul(x, weight.blocks, weight.bits, True)
    assert torch.equal(ops.code_matmul(x[3:12], weight.blocks, weight.bits, True), whole[3:12])
    torch.testing.assert_close(ops.code_dequantize(weight.blocks), want.float().T.bfloat16(), rtol=0, atol=0)


def _dequantize_op(tier: str):
    _kernel(tier)  # skips where the tier or the library is missing
    return cpu_decode.ops(resolve_tier(tier))


# Every record kind: 4-, 5- and 8-bit codes, with zeros (mins, offsets) and without (zeros from the scales).
RECORD_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"]


@pytest.mark.parametrize("qtype", RECORD_TYPES)
def test_dequantized_codes_are_the_weights_rounded_once_to_bfloat16(tier, qtype):
    """code_dequantize gives W^T [K, N]: every value the tiles hold (TiledCodes.dequantize, float32) rounded once to
    bfloat16, bit for bit, on every tier's kernel (AVX-512's permutes and the portable loops)."""
    from gguf import GGMLQuantizationType

    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        from gguf.quants import quantize

        raw = quantize(np.random.default_rng(5).standard_normal((48, 320)).astype(np.float32),
                       GGMLQuantizationType[qtype]).reshape(48, -1)
    else:
        raw, _ = _gguf_blocks(qtype, 48, 320, seed=5)
    weight = TiledCodes.from_codes(decode_blocks(raw, qtype, 48, 320))
    got = _dequantize_op(tier).code_dequantize(weight.blocks)
    assert got.shape == (320, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, weight.dequantize().float().T.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 64, 200])
def test_the_dequantized_matmul_is_the_matmul_of_the_weights(tier, rows):
    """dequantized_mm (the many-row projections' path where no dense copy is kept): x @ W^T within bfloat16's
    rounding of the weights and the output, for a weight wider than its scratch held before (the scratch grows)."""
    ops = _dequantize_op(tier)
    for n, k in ((32, 64), (80, 640)):
        weight = TiledCodes.from_codes(_q4_0(n, k, seed=n))
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = ops.dequantized_mm(x, weight.blocks)
        assert got.shape == (rows, n)
        assert relative_error(got, x.double() @ weight.dequantize().double().T) < CODE_TOLERANCE
    with pytest.raises(RuntimeError, match="dequantized_mm"):
        ops.dequantized_mm(torch.ones(2, 96, dtype=torch.bfloat16), weight.blocks)
