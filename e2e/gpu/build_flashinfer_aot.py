#!/usr/bin/env python3
"""Build the flashinfer bundle the GPU machine can take: a trimmed package plus sm_90 kernels compiled ahead of time.

Why: flashinfer-python is a JIT library. Its wheel carries ~400 MB of CUDA sources and ~250 MB of
Python, and compiles each kernel on first use (minutes per module). The GPU machine has no network
and takes at most 64 MiB per call, and a check of a few minutes cannot wait for a JIT build.

How (needs nvcc 13.0 and a host compiler, no GPU; run where flashinfer-python is pip-installed):
  1. a private CUDA_HOME next to the system toolkit, completed with the cuBLAS/cuRAND headers
     flashinfer's sources include (from the nvidia-cublas/nvidia-curand wheels) and a libcuda stub
     to link against (the real driver library is loaded on the GPU machine);
  2. flashinfer's own JIT specs for exactly the modules the engine calls, built for sm_90a with its
     own ninja rules (FLASHINFER_CUDA_ARCH_LIST=9.0): batch prefill over a paged cache (FA2; FA3 with
     --fa3) for bf16 at head_dim 128 and 64, RMSNorm, RoPE, SiLU-and-mul, sampling;
  3. the bundle: the flashinfer Python files that `import flashinfer` and those modules load (no CUDA
     sources, no other kernels' binaries), each built library at flashinfer/data/aot/<name>/<name>.so
     (where flashinfer looks before it would JIT), and apache-tvm-ffi for CPython 3.12 (the one
     dependency the GPU image lacks);
  4. a check in an environment that holds only what the GPU image holds: flashinfer imports, every
     module resolves to its prebuilt library, and each library loads.

    python e2e/gpu/build_flashinfer_aot.py --out .flashinfer_aot [--fa3] [--jobs 2]
Then see e2e/gpu/README.md for carrying .flashinfer_aot to the GPU machine.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

SYSTEM_CUDA = "/usr/local/cuda"
HEADER_WHEELS = ["nvidia-cublas==13.0.2.14", "nvidia-curand==10.4.0.35"]  # CUDA 13.0, as on the GPU machine
DEVICE_PYTHON = "3.12"  # the GPU image's python3
# Packages the GPU image already has (e2e/gpu/README.md); the check imports flashinfer beside only these.
DEVICE_PACKAGES = ["torch", "torchgen", "functorch", "numpy", "numpy.libs", "packaging", "requests", "certifi",
                   "charset_normalizer", "idna", "urllib3", "tqdm", "tabulate", "click", "einops", "ninja",
                   "pynvml.py", "jinja2", "markupsafe", "typing_extensions.py", "sympy", "mpmath", "networkx",
                   "filelock", "fsspec", "triton", "yaml", "_yaml"]
DEVICE_CUDA_NAMESPACE = ["bindings", "core", "pathfinder"]  # cuda-bindings, cuda-core, cuda-pathfinder


def module_specs(fa3: bool) -> list:
    """flashinfer's JIT specs for the engine's calls, named exactly as its runtime will look them up."""
    import torch
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module, gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module
    from flashinfer.jit.sampling import gen_sampling_module

    specs = []
    for head_dim in (128, 64):
        # (dtype_q, dtype_kv, dtype_o, dtype_idx, head_dim_qk, head_dim_vo, pos_encoding NONE,
        #  no sliding window, no logits soft cap, no fp16 QK reduction): what FlashInferBackend plans.
        args = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, head_dim, head_dim, 0, False, False, False)
        specs.append(_gen_batch_prefill_primary_module("fa2", *args))  # equal K/V strides: the engine's cache
        if fa3:
            specs.append(gen_batch_prefill_module("fa3", *args))
    specs += [gen_norm_module(), gen_rope_module(), gen_act_and_mul_module("silu"), gen_sampling_module()]
    return specs


def prepare_toolchain(work: str) -> str:
    """A CUDA_HOME that is the system toolkit plus the headers and the driver stub flashinfer needs to link."""
    home = os.path.join(work, "cudahome")
    if os.path.exists(os.path.join(home, "lib64", "stubs", "libcuda.so")):
        return home
    include = os.path.join(home, "include")
    lib64 = os.path.join(home, "lib64")
    os.makedirs(os.path.join(lib64, "stubs"), exist_ok=True)
    os.makedirs(include, exist_ok=True)
    if not os.path.exists(os.path.join(home, "bin")):
        os.symlink(os.path.join(SYSTEM_CUDA, "bin"), os.path.join(home, "bin"))
    for src, dst in ((os.path.join(SYSTEM_CUDA, "include"), include), (os.path.join(SYSTEM_CUDA, "lib64"), lib64)):
        for name in os.listdir(src):
            target = os.path.join(dst, name)
            if not os.path.lexists(target):
                os.symlink(os.path.join(src, name), target)
    wheels = os.path.join(work, "header_wheels")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels, *HEADER_WHEELS], check=True)
    for wheel in glob.glob(os.path.join(wheels, "*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if "/include/" in name and name.endswith(".h"):
                    with open(os.path.join(include, os.path.basename(name)), "wb") as f:
                        f.write(z.read(name))
        os.remove(wheel)
    # libcuda is the driver's; linking only needs the name. The SONAME matches the real library's.
    stub_c = os.path.join(work, "libcuda_stub.c")
    with open(stub_c, "w") as f:
        f.write("void stallfree_libcuda_stub(void) {}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    os.path.join(lib64, "stubs", "libcuda.so"), stub_c], check=True)
    return home


def build(specs: list, jobs: int, rebuild: bool) -> None:
    from flashinfer.jit.core import build_jit_specs

    os.environ["MAX_JOBS"] = str(jobs)
    for spec in specs:
        if spec.jit_library_path.exists() and not rebuild:
            print(f"built already: {spec.name}", flush=True)
            continue
        print(f"building {spec.name}", flush=True)
        build_jit_specs([spec], verbose=False, skip_prebuilt=False)
        if not spec.jit_library_path.exists():
            raise RuntimeError(f"{spec.name}: no library at {spec.jit_library_path}")
        print(f"  {spec.jit_library_path.stat().st_size / 1e6:.1f} MB", flush=True)


# Build-time parts of apache-tvm-ffi (headers, sources, Cython sources, a test library): not needed to load modules.
TVM_FFI_SKIP = ("3rdparty", "include", "src", "cython", "CMakeLists.txt")


def exercise_code(prefill_backends: list[str]) -> str:
    """Python run in the emulated GPU environment: import flashinfer, then load every module the engine calls
    through the getters flashinfer's own ops use (a prebuilt library loads on a CPU too), then print the
    package files that were imported. Lazy imports on these paths are thereby traced, and checked."""
    return f"""
import builtins, io, json, os, sys
# Source templates flashinfer reads from its data/ folder while it names and generates a module (before it
# finds the prebuilt library): recorded, so the bundle carries exactly those.
data_reads = set()
_open = io.open
def recording_open(file, *args, **kwargs):
    path = os.fspath(file) if isinstance(file, (str, bytes, os.PathLike)) else ""
    if isinstance(path, str) and os.sep + "flashinfer" + os.sep + "data" + os.sep in path:
        data_reads.add(path)
    return _open(file, *args, **kwargs)
builtins.open = io.open = recording_open
import torch
import flashinfer, flashinfer.prefill, flashinfer.norm, flashinfer.rope, flashinfer.activation, flashinfer.sampling
bf16 = torch.bfloat16
for backend in {prefill_backends!r}:
    for head_dim in (128, 64):
        flashinfer.prefill.get_batch_prefill_module(backend, bf16, bf16, bf16, torch.int32, head_dim, head_dim,
                                                    0, False, False, False)
flashinfer.norm.get_norm_module()
flashinfer.rope.get_rope_module()
flashinfer.activation.get_act_and_mul_module("silu")
flashinfer.sampling.get_sampling_module()
try:  # the wrapper's constructor on the CPU gets as far as its first device call
    flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="fa2")
except Exception as exc:
    print("wrapper on the CPU:", type(exc).__name__, file=sys.stderr)
root = os.path.dirname(flashinfer.__file__)
files = {{os.path.relpath(m.__file__, root) for m in list(sys.modules.values())
         if getattr(m, "__file__", None) and m.__file__.startswith(root)}}
files |= {{os.path.relpath(p, root) for p in data_reads if p.startswith(root)}}
print(json.dumps(sorted(files)))
"""


def _copy_libraries(specs: list, package: str) -> dict:
    """Each built library where flashinfer looks before it would compile: data/aot/<name>/<name>.so."""
    sizes = {}
    for spec in specs:
        target = os.path.join(package, "data", "aot", spec.name, f"{spec.name}.so")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(spec.jit_library_path, target)
        sizes[spec.name] = os.path.getsize(target)
    return sizes


def _local_tvm_ffi(site: str) -> None:
    """This interpreter's tvm_ffi, trimmed as the bundle's is (the bundle's own is built for the GPU's CPython)."""
    import tvm_ffi

    shutil.copytree(os.path.dirname(tvm_ffi.__file__), os.path.join(site, "tvm_ffi"),
                    ignore=shutil.ignore_patterns("__pycache__", *TVM_FFI_SKIP))


def traced_files(src: str, specs: list, emulated_site: str, prefill_backends: list[str]) -> set[str]:
    """Package files the engine's paths import, traced over every .py file of the package plus the built
    libraries, in the emulated GPU environment (so optional dependencies it lacks are not followed)."""
    site = tempfile.mkdtemp()
    shutil.copytree(src, os.path.join(site, "flashinfer"),
                    ignore=shutil.ignore_patterns("data", "__pycache__", "*.cu", "*.cuh", "*.h", "*.c", "*.cubin"))
    csrc = os.path.join(src, "data", "csrc")  # its top-level sources and templates (not the kernel libraries)
    os.makedirs(os.path.join(site, "flashinfer", "data", "csrc"))
    for name in os.listdir(csrc):
        if os.path.isfile(os.path.join(csrc, name)):
            shutil.copy2(os.path.join(csrc, name), os.path.join(site, "flashinfer", "data", "csrc", name))
    _copy_libraries(specs, os.path.join(site, "flashinfer"))
    _local_tvm_ffi(site)
    out = _run_emulated(exercise_code(prefill_backends), [emulated_site, site], _exercise_env())
    shutil.rmtree(site, ignore_errors=True)
    return set(json.loads(out.strip().splitlines()[-1]))


def _exercise_env() -> dict:
    return {"FLASHINFER_DISABLE_JIT": "1", "FLASHINFER_CUDA_ARCH_LIST": "9.0", "FLASHINFER_USE_CUDA_NORM": "1",
            "LD_LIBRARY_PATH": os.path.join(SYSTEM_CUDA, "lib64")}


def assemble(bundle: str, specs: list, emulated_site: str, tvm_ffi_wheel_dir: str,
             prefill_backends: list[str]) -> dict:
    import flashinfer

    src = os.path.dirname(flashinfer.__file__)
    site = os.path.join(bundle, "site")
    shutil.rmtree(site, ignore_errors=True)
    dst = os.path.join(site, "flashinfer")
    keep = traced_files(src, specs, emulated_site, prefill_backends)
    # Data files beside traced modules (configs they may read), and every package __init__ on the way.
    for rel in list(keep):
        folder = os.path.dirname(rel)
        keep.update(os.path.relpath(p, src) for p in glob.glob(os.path.join(src, folder, "*.json")))
        parts = folder.split(os.sep) if folder else []
        for i in range(1, len(parts) + 1):
            init = os.path.join(*parts[:i], "__init__.py")
            if os.path.exists(os.path.join(src, init)):
                keep.add(init)
    for rel in sorted(keep):
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(os.path.join(src, rel), os.path.join(dst, rel))
    modules = _copy_libraries(specs, dst)
    wheel = glob.glob(os.path.join(tvm_ffi_wheel_dir, "apache_tvm_ffi-*.whl"))
    if not wheel:
        raise RuntimeError("no apache-tvm-ffi wheel for the GPU machine's Python: see fetch_tvm_ffi_wheel()")
    with zipfile.ZipFile(wheel[0]) as z:
        for name in z.namelist():
            parts = name.split("/")
            if parts[0] == "tvm_ffi" and any(p in TVM_FFI_SKIP for p in parts[1:]):
                continue
            z.extract(name, site)
    return modules


def fetch_tvm_ffi_wheel(work: str) -> str:
    """apache-tvm-ffi at the installed version, built for CPython 3.12 on manylinux x86-64."""
    from importlib.metadata import version

    out = os.path.join(work, "device_wheels")
    if not glob.glob(os.path.join(out, "apache_tvm_ffi-*.whl")):
        platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        f"--python-version={DEVICE_PYTHON}", "--implementation=cp", *platforms, "-d", out,
                        f"apache-tvm-ffi=={version('apache-tvm-ffi')}"], check=True)
    return out


def emulated_device_site(work: str) -> str:
    """A site folder with only the packages the GPU image also has, linked from this environment."""
    import torch

    here = os.path.dirname(os.path.dirname(torch.__file__))
    site = os.path.join(work, "device_site")
    shutil.rmtree(site, ignore_errors=True)
    os.makedirs(os.path.join(site, "cuda"))
    for name in DEVICE_PACKAGES:
        if os.path.exists(os.path.join(here, name)):
            os.symlink(os.path.join(here, name), os.path.join(site, name))
    for name in DEVICE_CUDA_NAMESPACE:
        if os.path.exists(os.path.join(here, "cuda", name)):
            os.symlink(os.path.join(here, "cuda", name), os.path.join(site, "cuda", name))
    return site


def _run_emulated(code: str, path: list[str], extra_env: dict | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra_env or {})
    done = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"emulated GPU environment failed:\n{done.stderr[-3000:]}")
    return done.stdout


def verify(bundle: str, emulated_site: str, prefill_backends: list[str]) -> str:
    """In the emulated GPU environment, JIT disabled: flashinfer imports from the bundle alone and every module
    the engine calls loads from its prebuilt library (the CUDA runtime of the system toolkit stands in)."""
    site = os.path.join(bundle, "site")
    if sys.version_info[:2] != tuple(int(x) for x in DEVICE_PYTHON.split(".")):
        # The bundle's tvm_ffi is built for the GPU machine's CPython: check with this interpreter's own copy.
        local = os.path.join(tempfile.mkdtemp(), "site")
        shutil.copytree(site, local, ignore=shutil.ignore_patterns("tvm_ffi", "apache_tvm_ffi-*"))
        _local_tvm_ffi(local)
        site = local
    out = _run_emulated(exercise_code(prefill_backends), [emulated_site, site], _exercise_env())
    return f"flashinfer from the bundle alone: {len(json.loads(out.strip().splitlines()[-1]))} files imported, " \
           f"every module loaded from its prebuilt library"


def bundle_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".flashinfer_aot", help="bundle folder (ignore it in git; carry it to the GPU)")
    p.add_argument("--work", default=None, help="build folder (default: <out>.build)")
    p.add_argument("--fa3", action="store_true", help="also the Hopper FA3 prefill kernels (much longer build)")
    p.add_argument("--jobs", type=int, default=2, help="parallel nvcc jobs")
    p.add_argument("--rebuild", action="store_true", help="compile modules again even if the build folder has them")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work or out + ".build")
    os.makedirs(work, exist_ok=True)
    # flashinfer reads these at import: set them before the first import.
    os.environ["CUDA_HOME"] = prepare_toolchain(work)
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = "9.0"
    os.environ["FLASHINFER_WORKSPACE_BASE"] = work
    specs = module_specs(args.fa3)
    build(specs, args.jobs, args.rebuild)
    site = emulated_device_site(work)
    prefill_backends = ["fa2", "fa3"] if args.fa3 else ["fa2"]
    modules = assemble(out, specs, site, fetch_tvm_ffi_wheel(work), prefill_backends)
    summary = verify(out, site, prefill_backends)
    manifest = {"flashinfer": __import__("flashinfer").__version__, "arch": "sm_90a",
                "kernel_backend": "auto" if args.fa3 else "fa2", "modules": modules,
                "bundle_bytes": bundle_size(out)}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(summary.strip())
    print(f"bundle {out}: {manifest['bundle_bytes'] / 2**20:.1f} MiB, {len(modules)} modules, "
          f"kernel backend {manifest['kernel_backend']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
