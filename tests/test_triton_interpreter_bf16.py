"""What Triton's interpreter (TRITON_INTERPRET=1) does with bf16, measured: why the attention kernel computes in
fp32 there (DOT_FP32 in kernels/triton_attention.py) while the GPU runs bf16 dots. If a Triton release fixes
the interpreter, the first test fails: the kernel can then drop DOT_FP32 and test its bf16 dots on the CPU."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels below are decorated

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, UPCAST: tl.constexpr):
    r = tl.arange(0, M)
    a = tl.load(a_ptr + r[:, None] * M + r[None, :])
    b = tl.load(b_ptr + r[:, None] * M + r[None, :])
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    tl.store(c_ptr + r[:, None] * M + r[None, :], tl.dot(a, b))


@triton.jit
def _convert(src_ptr, dst_ptr, N: tl.constexpr, TO_BF16: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(src_ptr + i)
    tl.store(dst_ptr + i, x.to(tl.bfloat16) if TO_BF16 else x.to(tl.float32))


def test_interpreter_bf16_upcasts_exactly_and_rounds_down_by_truncation():
    """bf16 -> fp32 is exact; fp32 -> bf16 truncates (the GPU rounds to nearest even), so an output rounds with
    up to 2^-7 relative error instead of 2^-8: the bf16 tolerance of the kernel tests allows for it."""
    x = torch.randn(4096)
    up = torch.empty(4096)
    _convert[(1,)](x.bfloat16(), up, 4096, False)
    assert torch.equal(up, x.bfloat16().float())
    down = torch.empty(4096, dtype=torch.bfloat16)
    _convert[(1,)](x, down, 4096, True)
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert torch.equal(down.float(), truncated)
    assert not torch.equal(down, x.bfloat16())  # torch's cast rounds to nearest even
