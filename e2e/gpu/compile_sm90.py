"""Compile every Triton kernel variant the engine launches for sm_90 (H100/H200), on a machine without a GPU.

Triton lowers to PTX and its bundled ptxas assembles for any target, no driver needed. This catches
compile errors before a GPU session and shows what each variant costs on Hopper: registers, spills,
shared memory, and whether the tile uses wgmma (Hopper's matrix instructions) or only mma.sync, and
cp.async pipelining of the paged K/V loads.

The signatures mirror what Triton's JIT specialises at run time for the engine's tensors: 16-byte
aligned pointers and strides divisible by 16 (contiguous caches and head_dim 64/128 give both).

    python e2e/gpu/compile_sm90.py [--json PATH] [--arch 90]
Exit status 1 if a default launch shape spills registers or fails to compile.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU even if a test process set the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from stallfree.kernels import triton_attention, triton_kv_write  # noqa: E402
from stallfree.kernels.triton_attention import KernelConfig, choose_config  # noqa: E402

INDEX_POINTERS = {"query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "slot_mapping_ptr"}
NOT_DIVISIBLE = {"num_seqs"}  # a count, not a stride: Triton would not specialise it


@dataclass
class Variant:
    kernel: str
    label: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    matrix_path: str  # wgmma | mma.sync | none
    cp_async: bool
    default: bool  # a launch shape the engine picks by itself


def _signature(fn, constexprs: dict, dtype: str) -> tuple[dict, dict]:
    sig: dict[str, str] = {}
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            if name == "slot_mapping_ptr":
                sig[name] = "*i64"
            elif name in INDEX_POINTERS:
                sig[name] = "*i32"
            elif name.startswith("partial"):
                sig[name] = "*fp32"
            else:
                sig[name] = f"*{dtype}"
        elif name == "qk_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name] != "fp32" and name not in NOT_DIVISIBLE:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_variant(fn, constexprs: dict, num_warps: int, num_stages: int, dtype: str, arch: int) -> dict:
    sig, attrs = _signature(fn, constexprs, dtype)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = kernel.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    path = "wgmma" if "wgmma.mma_async" in ptx else ("mma.sync" if "mma.sync" in ptx else "none")
    return dict(registers=regs, spill_bytes=spills, shared_bytes=int(kernel.metadata.shared), matrix_path=path,
                cp_async="cp.async" in ptx)


def attention_variants() -> list[tuple[str, dict, KernelConfig, int, bool]]:
    """(label, constexprs, config, num_splits, is_default) for each model shape the engine ships."""
    out = []
    for model, group, head_dim in (("llama-3-8b", 4, 128), ("smollm2-135m", 3, 64), ("qwen2-0.5b", 7, 64)):
        cases = [("decode", 1, 1), ("decode split-KV", 1, 4), ("short chunks", 16, 1), ("prefill chunk", 2048, 1)]
        for name, max_q, splits in cases:
            config = choose_config(max_q, group, on_gpu=True)
            out.append((f"{model} {name}", _attention_constexprs(group, head_dim, config, splits), config, splits, True))
    # Alternatives gpu_check.py sweeps, compiled here so a bad one shows before a GPU session.
    for config in (KernelConfig(128, 32, 8, 2), KernelConfig(128, 64, 8, 3), KernelConfig(64, 64, 8, 2),
                   KernelConfig(16, 128, 4, 2), KernelConfig(16, 64, 4, 3)):
        out.append((f"llama-3-8b alt {config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}",
                    _attention_constexprs(4, 128, config, 1), config, 1, False))
    return out


def _attention_constexprs(group: int, head_dim: int, config: KernelConfig, splits: int) -> dict:
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_Q=config.block_m // group, BLOCK_M=config.block_m, BLOCK_N=config.block_n, PAGE_SIZE=16,
                NUM_SPLITS=splits, IEEE_DOT=False, DOT_FP32=False)  # the GPU path: bf16 dots


def run(arch: int, dtype: str, quick: bool = False) -> list[Variant]:
    results = []
    variants = attention_variants()
    if quick:  # the engine's two Llama-3 launch shapes only (decode, prefill chunk)
        variants = [v for v in variants if v[0] in ("llama-3-8b decode", "llama-3-8b prefill chunk")]
    for label, consts, config, _splits, default in variants:
        r = compile_variant(triton_attention._paged_attention_kernel, consts, config.num_warps, config.num_stages,
                            dtype, arch)
        results.append(Variant("paged_attention", f"{label} ({config.block_m}x{config.block_n}, "
                                                  f"{config.num_warps} warps, {config.num_stages} stages)",
                               default=default, **r))
    for heads, head_dim in ((8, 128), (3, 64))[:1 if quick else 2]:
        consts = dict(NUM_KV_HEADS=heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(heads),
                      BLOCK_D=head_dim)
        r = compile_variant(triton_kv_write._write_kv_kernel, consts, 4, 1, dtype, arch)
        results.append(Variant("write_kv", f"{heads} KV heads x {head_dim}", default=True, **r))
    for splits in () if quick else (2, 16):
        consts = dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=splits)
        r = compile_variant(triton_attention._merge_splits_kernel, consts, 4, 1, dtype, arch)
        results.append(Variant("merge_splits", f"{splits} splits x 128", default=True, **r))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: H100/H200)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--json", help="write the table here as JSON")
    parser.add_argument("--quick", action="store_true", help="only the Llama-3 decode and prefill shapes")
    args = parser.parse_args(argv)
    try:
        results = run(args.arch, args.dtype, args.quick)
    except Exception as exc:  # a compile error is the finding: report it, fail
        print(f"compile failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"Triton {triton.__version__}, sm_{args.arch}a, {args.dtype}")
    print(f"{'kernel':<16}{'variant':<66}{'regs':>5}{'spill B':>9}{'smem B':>9}  matrix    cp.async")
    for v in results:
        print(f"{v.kernel:<16}{v.label:<66}{v.registers:>5}{v.spill_bytes:>9}{v.shared_bytes:>9}  "
              f"{v.matrix_path:<9} {'yes' if v.cp_async else 'no'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "arch": args.arch, "dtype": args.dtype,
                       "variants": [asdict(v) for v in results]}, f, indent=1)
    bad = [v for v in results if v.default and v.spill_bytes]
    for v in bad:
        print(f"SPILLS: {v.kernel} {v.label}: {v.spill_bytes} bytes", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
