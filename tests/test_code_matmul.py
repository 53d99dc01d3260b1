"""The compiled VNNI kernel (models/cpu_vnni_matmul.h) on GGUF block codes: its layout holds exactly the weights
gguf dequantizes to, and its matmul (int16 activations, integer dot products) is the float64 matmul of those
weights within bfloat16's rounding of the output, on SmolLM2's own Q4_1 and Q8_0 tensors and on Q4_0 blocks, for
row counts on both sides of its 8-row passes; a zero block, wide-ranging activations and zero rows hold, and a
weight of the wrong width is refused with a clear error.

The extension is compiled once per machine into the stallfree cache; without a C++ compiler or AVX512-VNNI these
tests skip (the int4 path stays in use there)."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from model_helpers import relative_error
from stallfree.node_daemon.models import cpu_decode
from stallfree.node_daemon.models.quantized import BlockCodes, VnniWeight, cpu_has_vnni, decode_blocks

# bfloat16 output rounding (2^-9 of a value) is the kernel's error: measured 0.0016-0.0017 here, int16 activations'
# rounding adding nothing visible. int8 activations measured 0.015-0.024 on the same tensors.
VNNI_TOLERANCE = 4e-3
# float32 output: int16 activations' rounding alone (measured 1.1e-4 here), a tenth of bfloat16's 2^-9.
FLOAT_OUT_TOLERANCE = 3e-4


@functools.lru_cache(maxsize=None)
def _kernel():
    if not cpu_has_vnni():
        pytest.skip("this CPU has no AVX512-VNNI")
    if not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled extension unavailable: {cpu_decode.why_not()}")
    return torch.ops.stallfree_cpu.vnni_matmul


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


def _matmul(weight: VnniWeight, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
    return _kernel()(x, weight.blocks, weight.bits, float_out)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"])
def test_layout_holds_the_gguf_weights(name):
    codes = _codes(name)
    weight = VnniWeight.from_codes(codes)
    assert weight.bits == (8 if codes.qtype == "Q8_0" else 4)
    want = codes.dequantize()
    np.testing.assert_allclose(weight.dequantize().numpy(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_gate.weight", "blk.7.ffn_down.weight",
                                  "token_embd.weight"])
def test_matmul_is_the_dequantized_one(name, rows):
    codes = _codes(name)
    width = codes.codes.shape[1] // codes.planes
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = _matmul(VnniWeight.from_codes(codes), x)
    want = x.double() @ torch.from_numpy(codes.dequantize()).double().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, codes.rows)
    assert relative_error(got, want) < VNNI_TOLERANCE
    exact = _matmul(VnniWeight.from_codes(codes), x, float_out=True)  # an LM head's logits: the float32 sums
    assert exact.dtype == torch.float32 and relative_error(exact, want) < FLOAT_OUT_TOLERANCE


def test_q4_0_blocks_with_a_zero_block_and_wide_ranging_rows():
    codes = _q4_0(48, 128, seed=3)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    x[0, 32:64] = 0.0  # a block of zeros: its scale is 0, it adds nothing
    x[1] *= 1e4  # large and small rows: each block has its own scale
    x[2] *= 1e-4
    x = x.bfloat16()
    got = _matmul(VnniWeight.from_codes(codes), x)
    want = x.double() @ torch.from_numpy(codes.dequantize()).double().T
    for r in range(4):
        assert relative_error(got[r], want[r]) < VNNI_TOLERANCE


def test_no_rows_and_a_weight_of_the_wrong_width():
    weight = VnniWeight.from_codes(_q4_0(16, 64, seed=4))
    assert _matmul(weight, torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 16)
    with pytest.raises(RuntimeError, match="do not match x's width"):
        _matmul(weight, torch.zeros(2, 96, dtype=torch.bfloat16))
