"""Which x86 instruction-set tier the CPU kernels take, read once from the CPU's flags (torch-free).

One engine serves every tier; what changes between them is the compiled extension's kernels (models/cpu_decode.py
builds one per tier) and which matmul takes a many-row iteration:

    tier         the CPU has                        few rows (decode)        many rows (prefill chunks)
    avx512_bf16  AVX-512 F/BW/VL/DQ + BF16 (+AMX)   VNNI kernel, else int4   oneDNN bfloat16 GEMM (prepacked copy)
    avx512       AVX-512 F/BW/VL/DQ                 VNNI kernel, else int4   oneDNN bfloat16 GEMM (prepacked copy)
                 ... with VNNI and no AMX                                    VNNI kernel, int8 (no dense copy)
    avx2         AVX2 + FMA + F16C                  AVX2 code kernel         AVX2 code kernel (no dense copy)
    generic      anything else (x86-64, ARM, ...)   portable code kernel     portable code kernel (no dense copy)

oneDNN's bfloat16 reorder needs AVX512 BW/VL/DQ (or AVX-NE-CONVERT): below that it refuses, so those tiers serve
every matmul from the GGUF codes. STALLFREE_CPU_TIER=avx2 (or avx512, generic) forces a lower tier on a bigger CPU,
so each path is served, tested and benchmarked there too; asking for a tier the CPU lacks is an error. At the
command line (`stallfree ...`) the same variable also caps torch's own kernels (ATEN_CPU_CAPABILITY) and oneDNN's
(ONEDNN_MAX_CPU_ISA) at that tier, unless those are set, so a forced tier runs the instructions that CPU would.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

ENV = "STALLFREE_CPU_TIER"
TIERS = ("generic", "avx2", "avx512", "avx512_bf16")  # lowest first
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
}
# The compiler's target per tier. The AVX-512 tiers build for this CPU (-march=native; avx512 drops BF16 for a
# forced run); avx2 for x86-64-v3 (Haswell, Zen 1-3), so a forced tier uses only the instructions that CPU has.
_CFLAGS = {
    "avx512_bf16": ["-march=native"],
    "avx512": ["-march=native", "-mno-avx512bf16"],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
    "generic": [],
}
# What torch and oneDNN are capped at for a forced tier (their own names for it).
_ATEN_CAPABILITY = {"avx2": "avx2", "avx512": "avx512", "generic": "default"}
_ONEDNN_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE_VNNI", "generic": "SSE41"}


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> list[str]:
    """/proc/cpuinfo's first processor's lines ([] where there is none), read once."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().split("\n\n", 1)[0].splitlines()
    except OSError:
        return []


def cpu_flags() -> str:
    """/proc/cpuinfo's flags line ("" where there is none): what the CPU kernels can use."""
    return next((line for line in _cpuinfo() if line.startswith("flags")), "")


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (AuthenticAMD, GenuineIntel; "" where there is none)."""
    return next((line for line in _cpuinfo() if line.startswith("vendor_id")), "").split(":", 1)[-1].strip()


def detected_tier(flags: str | None = None) -> str:
    """The highest tier whose instructions the CPU has (generic off x86)."""
    have = set((cpu_flags() if flags is None else flags).split(":", 1)[-1].split())
    if flags is None and platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    best = "generic"
    for tier in TIERS[1:]:
        if all(f in have for f in _NEEDS[tier]):
            best = tier
    return best


@dataclass(frozen=True)
class CpuTier:
    name: str
    detected: str  # what the CPU could take; name is lower when forced
    vnni: bool  # AVX512-VNNI integer dot products for the code kernel (AVX-512 tiers only)
    amx: bool = False  # AMX bfloat16 tiles, where oneDNN runs ATen's bfloat16 GEMMs (the top tier, not forced lower)
    amd: bool = False  # an AMD CPU: MKL's float32 GEMM (ATen's attention below AVX512-BF16) takes its slower path

    @property
    def forced(self) -> bool:
        return self.name != self.detected

    @property
    def onednn_bf16(self) -> bool:
        """oneDNN's bfloat16 GEMMs (prepacked copies for many-row iterations) run here."""
        return self.name in ("avx512", "avx512_bf16")

    @property
    def int8_outruns_onednn(self) -> bool:
        """The code kernel's int8 products (AVX512-VNNI's VPDPBUSD) outrun oneDNN's bfloat16 GEMM at every row count:
        a VNNI CPU without AMX (AMD Zen 4, Intel Ice Lake). There a coded projection keeps no oneDNN copy and is never
        dequantized for one (models/quantized.py dequantize_min_rows, models/loader.py dense_copy_wanted)."""
        return self.vnni and not self.amx

    @property
    def bf16_native(self) -> bool:
        """The CPU multiplies bfloat16 itself (AVX512-BF16): the attention kernels' dot products."""
        return self.name == "avx512_bf16"

    @property
    def cflags(self) -> list[str]:
        return list(_CFLAGS[self.name])

    def describe(self) -> str:
        """One line for start-up logs and /metrics: the tier, and that it was forced where it was."""
        return self.name + (f" (forced by {ENV}; the CPU has {self.detected})" if self.forced else "")


def resolve_tier(requested: str | None, flags: str | None = None, vendor: str | None = None) -> CpuTier:
    """The tier to run: the CPU's own, or a lower one asked for. ValueError for an unknown or missing tier."""
    detected = detected_tier(flags)
    have = set((cpu_flags() if flags is None else flags).split())
    name = detected
    if requested:
        if requested not in TIERS:
            raise ValueError(f"{ENV}={requested!r} is not a tier; use one of {', '.join(TIERS)}")
        if TIERS.index(requested) > TIERS.index(detected):
            raise ValueError(f"{ENV}={requested} needs {', '.join(_NEEDS[requested])}; this CPU's tier is {detected}")
        name = requested
    vnni = name.startswith("avx512") and "avx512_vnni" in have
    amx = name == "avx512_bf16" and name == detected and "amx_bf16" in have
    amd = (cpu_vendor() if vendor is None else vendor) == "AuthenticAMD"
    return CpuTier(name=name, detected=detected, vnni=vnni, amx=amx, amd=amd)


@functools.lru_cache(maxsize=1)
def cpu_tier() -> CpuTier:
    """This process's tier ($STALLFREE_CPU_TIER or the CPU's own), fixed for its life."""
    return resolve_tier(os.environ.get(ENV) or None)


def cap_libraries_at_forced_tier(environ: dict[str, str] | None = None) -> None:
    """For a forced tier, cap torch's and oneDNN's kernels at it too (before torch is imported; settings already
    there win). Called by the command line: a forced AVX2 run then runs only AVX2 code, as on an AVX2 CPU."""
    env = os.environ if environ is None else environ
    tier = env.get(ENV)
    if not tier or tier not in _ATEN_CAPABILITY:
        return
    env.setdefault("ATEN_CPU_CAPABILITY", _ATEN_CAPABILITY[tier])
    env.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_ISA[tier])
