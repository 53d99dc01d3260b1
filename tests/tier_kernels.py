"""The compiled library of one CPU tier, for the kernel tests that run each tier's form where the CPU has it:
AVX512-BF16, and AVX2 forced on a bigger CPU (its own library, loaded beside the serving one)."""
from __future__ import annotations

import pytest

from stallfree.node_daemon.models import cpu_decode
from stallfree.node_daemon.models.cpu_tier import TIERS, _NEEDS, detected_tier, resolve_tier

KERNEL_TIERS = ["avx512_bf16", "avx2"]


def tier_kernels(tier: str):
    """The tier's ops, or the test skips: the CPU lacks the tier, or there is no compiled library (no C++
    compiler, a failed compile)."""
    if TIERS.index(tier) > TIERS.index(detected_tier()):
        pytest.skip(f"this CPU lacks the {tier} tier ({', '.join(_NEEDS[tier])})")
    kernels = cpu_decode.kernels_for(resolve_tier(tier))
    if kernels is None:
        pytest.skip("compiled extension unavailable (no C++ compiler, or the compile failed: see the log)")
    return kernels
