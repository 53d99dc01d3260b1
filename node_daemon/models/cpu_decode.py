"""Iterations of an int4 (GGUF) model on the CPU in one compiled call: models/cpu_decode.cpp, built for the CPU's tier.

A decode step of a small model run op by op is bound by the ops' count and the Python around them, not by its
arithmetic (`stallfree bench iteration --breakdown`). cpu_decode.cpp runs a whole forward in C++: the projections
straight from the GGUF codes (cpu_code_matmul.h: AVX512-VNNI, AVX2 or portable loops) for every row count below
AVX-512; on AVX-512 up to DEQUANT_MIN_ROWS, then the codes dequantized a projection at a time for oneDNN's bfloat16
GEMM (cpu_code_dequantize.h), or where they are kept the oneDNN-prepacked copies past CODE_MAX_ROWS
(the Python path's choice; a float projection of an F16/BF16/F32 file takes its oneDNN copy or ATen's linear at
every row count), plain loops for the norms, RoPE with the KV write and SiLU-and-mul, and attention:
AVX512-BF16 kernels for decode rows (cpu_decode_attention.h) and prefill chunks (cpu_chunk_attention.h) where the
tier has them, else a float32 loop (AVX2 or portable) and ATen's scaled_dot_product_attention (the Python path's
call). It takes decode-only iterations of up to MAX_ROWS rows and iterations with prefill chunks of any size
(a serving load's mixed iterations: the decodes plus a chunk). Decode-only batches past MAX_ROWS stay on the
Python path, as does a model not in bfloat16 on the CPU.

The extension is compiled once per source, torch build, CPU and tier (models/cpu_tier.py; the key of its folder in
$STALLFREE_EXT_CACHE, else $XDG_CACHE_HOME/stallfree/ext), its ops in a namespace of the tier's
(torch.ops.stallfree_cpu_avx2, ...: two tiers' libraries load side by side), and loaded from there in
milliseconds afterwards. It is never compiled on the serving path: `ensure_built(background=True)` compiles it in a
nice-19 child process while the Python path serves (killed with its compilers if the daemon stops first), and the
runner switches over at the next iteration once it is loaded. `kernels_for(tier)` builds and loads another
tier's library in the foreground (tests and benchmarks of a lower tier on a bigger CPU).
STALLFREE_CPU_DECODE=0 turns it off; STALLFREE_CPU_MIXED=0 keeps iterations with a prefill chunk on the Python
path, STALLFREE_CPU_CHUNK_KERNEL=0 gives prefill chunks ATen's attention instead of the AVX512-BF16 kernel
(cpu_chunk_attention.h), STALLFREE_CPU_CODE_KERNEL=0 gives the projections torch's int4 kernel and oneDNN's, and
STALLFREE_CPU_INT8=0 keeps the code kernel's activations int16 at every row count (A/B switches); without a C++ compiler it stays off and start-up says why.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from stallfree.node_daemon.models.cpu_tier import CpuTier, cpu_flags, cpu_tier
from stallfree.node_daemon.models.quantized import (CODE_MAX_ROWS, INT4_MAX_ROWS, INT8_MIN_ROWS, dequantize_min_rows,
                                                    int8_switched_on)

if TYPE_CHECKING:
    from stallfree.node_daemon.models.llama import KVCache, LlamaForCausalLM

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
# Included by SOURCE: part of the build key.
HEADERS = [Path(__file__).with_name(name)
           for name in ("cpu_argmax.h", "cpu_chunk_attention.h", "cpu_code_dequantize.h", "cpu_code_matmul.h",
                        "cpu_decode_attention.h", "cpu_gguf_tiles.h", "cpu_vnni_matmul.h")]
ENV_SWITCH = "STALLFREE_CPU_DECODE"
MIXED_SWITCH = "STALLFREE_CPU_MIXED"
CHUNK_KERNEL_SWITCH = "STALLFREE_CPU_CHUNK_KERNEL"
CODE_KERNEL_SWITCH = "STALLFREE_CPU_CODE_KERNEL"
# -fopenmp: ATen's at::parallel_for is a header template over OpenMP pragmas, so without it every kernel here ran
# on one thread (torch's own libgomp serves the pragmas: the library needs libgomp.so.1, the soname torch loaded).
_CFLAGS = ["-O3", "-fopenmp"]  # and the tier's target (CpuTier.cflags)
_LDFLAGS = ("-fopenmp",)  # a tuple: cpp_extension.load appends to the list it is given
# Decode batches up to this many rows take the compiled path.
MAX_ROWS = 64

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "why": None, "thread": None, "child": None}


def enabled(switch: str = ENV_SWITCH) -> bool:
    return os.environ.get(switch, "1") not in ("0", "false", "no", "off")


def namespace(tier: CpuTier) -> str:
    """The torch.ops namespace of the tier's library."""
    return f"stallfree_cpu_{tier.name}"


def compile_flags(tier: CpuTier) -> list[str]:
    return [*_CFLAGS, *tier.cflags, f"-DSTALLFREE_OPS_NS={namespace(tier)}"]


def build_key(tier: CpuTier | None = None) -> str:
    """What the compiled file depends on: the sources, the flags, torch's build, the CPU and the tier."""
    tier = tier or cpu_tier()
    digest = hashlib.sha256()
    flags = " ".join([*compile_flags(tier), *_LDFLAGS])
    parts = (SOURCE.read_bytes(), *(h.read_bytes() for h in HEADERS), flags.encode(),
             torch.__version__.encode(), cpu_flags().encode(), tier.name.encode())
    for part in parts:
        digest.update(part)
    return f"{tier.name}-{digest.hexdigest()[:16]}"


def cache_root() -> Path:
    if os.environ.get("STALLFREE_EXT_CACHE"):
        return Path(os.environ["STALLFREE_EXT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stallfree" / "ext"


def _library_path(key: str) -> Path:
    return cache_root() / key / f"stallfree_cpu_{key.replace('-', '_')}.so"


def ops(tier: CpuTier | None = None):
    """The loaded library's ops (torch.ops.stallfree_cpu_<tier>)."""
    return getattr(torch.ops, namespace(tier or cpu_tier()))


def _compile_or_load(tier: CpuTier, build: bool) -> str | None:
    """Load the tier's cached library, compiling it first when `build` and it is missing; None once loaded, else
    why not. The caller holds _lock."""
    key = build_key(tier)
    library = _library_path(key)
    if library.exists():
        torch.ops.load_library(str(library))
        return None
    if not build:
        return "not compiled yet"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on PATH"
    from torch.utils import cpp_extension

    started = time.monotonic()
    library.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _one_build_at_a_time(library.parent):
            built = cpp_extension.load(name=library.stem, sources=[str(SOURCE)], extra_cflags=compile_flags(tier),
                                       extra_ldflags=list(_LDFLAGS), build_directory=str(library.parent),
                                       is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # a failed compile: the Python path stays
        why = f"compile failed: {str(exc).splitlines()[0][:200]}"
        log.warning("compiled CPU decode path (%s): %s", tier.name, why)
        return why
    log.info("compiled CPU decode path for %s in %.1f s (%s)", tier.name, time.monotonic() - started, built)
    return None


_loaded_tiers: set[str] = set()
_on_load: list = []


def when_loaded(callback) -> None:
    """Call `callback()` once the serving tier's library has loaded (from the background build's thread), unless
    it already has (the caller has read the state then)."""
    with _lock:
        if not _state["loaded"]:
            _on_load.append(callback)


def kernels_for(tier: CpuTier):
    """Another tier's library (compiled here if needed), loaded beside the serving one: its ops, or None with the
    reason logged (no compiler, a failed compile)."""
    with _lock:
        if tier.name not in _loaded_tiers:
            why = _compile_or_load(tier, build=True)
            if why is not None:
                log.warning("%s kernels unavailable: %s", tier.name, why)
                return None
            _loaded_tiers.add(tier.name)
    return ops(tier)


def paths_taken(dense_copy: bool | None = None) -> dict[str, str]:
    """Which kernel each part of the CPU forward takes now (start-up logs, /metrics' engine info, benchmarks).
    `dense_copy`: whether the model holds oneDNN copies for many-row iterations (None: as the tier allows)."""
    tier = cpu_tier()
    onednn = tier.onednn_bf16 if dense_copy is None else dense_copy
    if not is_loaded():
        why = why_not() or "compiling"
        return {"cpu_tier": tier.name, "forward": f"python ({why})", "matmul": "torch int4 (few rows), " +
                ("oneDNN bfloat16" if onednn else "torch int4") + " (many rows)", "attention": "aten"}
    kernels = ops()
    code_on = enabled(CODE_KERNEL_SWITCH)
    code = str(kernels.code_kernel()) if code_on else "torch int4"
    int8_from = int8_min_rows() if code_on else 0
    code_many = f"{code} (int8 activations from {int8_from} rows)" if int8_from else code
    if onednn and code_on and (upto := code_max_rows()) > CODE_MAX_ROWS:
        many = f"{code_many} up to {upto} rows, oneDNN bfloat16 prepacked past them"
    elif onednn:
        many = "oneDNN bfloat16 prepacked"
    elif code_on and (min_rows := dequantize_min_rows()):
        many = f"{code_many} below {min_rows}, oneDNN bfloat16 from {min_rows} (codes dequantized a projection at a time)"
    else:
        many = code_many
    chunks = str(kernels.chunk_attention_kernel()) if chunk_kernel_wanted() else "aten"
    return {"cpu_tier": tier.name, "forward": "compiled", "matmul": f"{code} (few rows), {many} (many rows)",
            "attention": f"{kernels.attention_kernel()} (decode), {chunks} (chunks)"}


def is_loaded() -> bool:
    return bool(_state["loaded"])


def is_building() -> bool:
    """Whether a background build is under way (the Python path serves until it loads)."""
    thread = _state["thread"]
    return thread is not None and thread.is_alive() and not _state["loaded"]  # type: ignore[union-attr]


def why_not() -> str | None:
    """Why the compiled path is not in use (None once loaded, or while a build is under way)."""
    return None if _state["loaded"] else _state["why"]  # type: ignore[return-value]


def _load_or_build(build: bool) -> bool:
    """Load the serving tier's cached library; compile it first when `build` and it is missing. True once loaded."""
    with _lock:
        if _state["loaded"]:
            return True
        tier = cpu_tier()
        why = _compile_or_load(tier, build)
        if why is not None:
            _state["why"] = why
            return False
        _loaded_tiers.add(tier.name)
        kernels = ops(tier)
        kernels.set_chunk_kernel(chunk_kernel_wanted())
        _state["loaded"], _state["why"] = True, None
        return True


def int8_min_rows() -> int:
    """Rows from which the compiled forward's code kernel takes int8 activations (quantized.INT8_MIN_ROWS) where the
    loaded library has an int8 kernel (VNNI's VPDPBUSD, AVX2's VPMADDUBSW); 0 (never) elsewhere, before it loads,
    and under STALLFREE_CPU_INT8=0."""
    if not _state["loaded"] or not int8_switched_on() or not ops().int8_kernel():
        return 0
    return INT8_MIN_ROWS


def code_max_rows() -> int:
    """Rows up to which the code kernel takes a projection that has a oneDNN copy too: quantized.CODE_MAX_ROWS, or
    on a CPU without AMX whose library has the int8 kernel, every decode iteration (MAX_ROWS: its int8 products
    beat oneDNN's bfloat16 GEMM there; quantized.py)."""
    return MAX_ROWS if int8_min_rows() and not cpu_tier().amx else CODE_MAX_ROWS


def is_built() -> bool:
    """Whether the serving tier's library is loaded or compiled and cached (never compiles nor loads it)."""
    return is_loaded() or _library_path(build_key(cpu_tier())).exists()


def load_if_built() -> bool:
    """Load the serving tier's library where it is already built (never compiles): True once loaded."""
    return _load_or_build(build=False)


def dequantize_tiles(tiles, dtype: torch.dtype) -> torch.Tensor:
    """A coded weight's dense values [N, K] in `dtype` (a oneDNN copy made from the codes): the compiled library's
    code_rows where it is already built for this tier (one pass, all threads), else torch's ops (TiledCodes)."""
    if dtype == torch.bfloat16 and enabled() and load_if_built():
        return torch.cat([ops().code_rows(t.blocks, torch.arange(t.blocks.shape[0] * 16)) for t in tiles.pieces()])
    return tiles.dequantize().to(dtype)


def publish_code_kernel(model: "LlamaForCausalLM") -> None:
    """The model's quantized matmuls, here and on the Python path (Int4Weight.matmul), take the loaded library's
    code kernel: a few rows where a oneDNN copy takes the rest (AVX-512); where there is none, every row count
    below AVX-512, and on AVX-512 up to dequantize_min_rows(), its dequantized_mm from there. Its
    runner calls it between iterations (engine/forward_path.py) once the library has loaded: per model, so another
    engine in the process keeps its own choice."""
    if _state["loaded"] and enabled(CODE_KERNEL_SWITCH):
        min_rows = dequantize_min_rows()
        model.use_code_kernel(ops().code_matmul, code_max_rows(),
                              (ops().dequantized_mm, min_rows) if min_rows else None, int8_min_rows())


def chunk_kernel_wanted() -> bool:
    """Whether prefill chunks take the compiled chunk kernel (cpu_chunk_attention.h) rather than ATen's attention:
    STALLFREE_CPU_CHUNK_KERNEL where set; else the AVX512-BF16 kernel where there is no AMX, and the AVX2 kernel on
    AMD. Measured with `stallfree bench iteration --chunk 256 --prefix 1024 --breakdown` (2 threads, the switch 0
    and 1; ms of chunk attention a forward):
    - AMD Zen 4: the AVX512-BF16 kernel 1.7x faster than ATen's. Forced to AVX2, where ATen's attention runs on
      MKL's float32 GEMM (its AMD path), the AVX2 kernel: SmolLM2 112-116 against 161, the 1B 213-218 against 298,
      Gemma 3 59-64 against 141 (ATen computes every pair of a sliding layer's band).
    - Intel Sapphire Rapids, where oneDNN runs ATen's bfloat16 GEMMs on AMX tiles: ATen's 59 against the kernel's
      138 for SmolLM2, 30 against 47 for Gemma 3; capped at AVX2 (both sides), ATen's 91 and 53 against 313 and 91
      for the AVX2 kernel before its loops were turned around and its softmax vectorized (2-2.1x faster since, on
      the Zen 4: not measured on an Intel since, so Intel keeps ATen's)."""
    if CHUNK_KERNEL_SWITCH in os.environ:
        return enabled(CHUNK_KERNEL_SWITCH)
    tier = cpu_tier()
    if tier.name == "avx2":
        return tier.amd
    return tier.name == "avx512_bf16" and not tier.amx


@contextlib.contextmanager
def _one_build_at_a_time(folder: Path):
    """Hold an flock on the build folder for a build (the kernel drops it with its process, however that ends),
    and clear cpp_extension's own lock file there first: a build killed mid-way leaves that file, and every
    later build would wait on it forever. No build runs while this flock is held, so the file is stale."""
    import fcntl

    with open(folder / "stallfree-build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        yield


def ensure_built(background: bool) -> bool:
    """Load the compiled path, compiling it if needed: in a nice-19 child process watched by a thread when
    `background` (returns at once, False until it is loaded), else here. False when switched off."""
    if not enabled():
        _state["why"] = f"{ENV_SWITCH}=0"
        return False
    if _load_or_build(build=False):
        return True
    if not background:
        return _load_or_build(build=True)
    with _lock:
        thread = _state["thread"]
        if thread is None or not thread.is_alive():  # type: ignore[union-attr]
            thread = threading.Thread(target=_build_quietly, name="cpu-decode-build", daemon=True)
            _state["thread"], _state["why"] = thread, "compiling (the Python path serves meanwhile)"
            thread.start()
    return False


def _build_quietly() -> None:
    """Compile in a child process (`python -m` this module) at nice 19, in a session of its own, then load. The
    compilers inherit both: serving keeps the cores, and a daemon that stops takes its compilers with it (at exit
    it kills the session; a child whose parent dies kills its own), instead of leaving them to run ~20 s."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        _state["why"] = "no C++ compiler (c++) on PATH"
        return
    started = time.monotonic()
    try:
        child = subprocess.Popen([sys.executable, "-m", __name__], start_new_session=True)
    except OSError as exc:
        _state["why"] = f"compile failed: {exc}"
        return
    _state["child"] = child
    atexit.register(_stop_build)
    code = child.wait()
    # Loaded here, on the build thread: the serving runner switches kernels itself between two iterations.
    if _load_or_build(build=False):
        log.info("compiled CPU decode path in %.1f s (%s)", time.monotonic() - started, _library_path(build_key()))
        while _on_load:
            _on_load.pop(0)()
    elif code < 0:  # killed: this process is stopping (_stop_build), or someone stopped the build
        _state["why"] = f"compile stopped (signal {-code})"
        log.info("compiled CPU decode path: %s", _state["why"])
    elif code != 0:
        _state["why"] = f"compile failed (exit code {code}; the compiler's messages are above)"
        log.warning("compiled CPU decode path: %s", _state["why"])


def _stop_build() -> None:
    child = _state.get("child")
    if child is not None and child.poll() is None:  # type: ignore[union-attr]
        kill_session(child.pid)  # type: ignore[union-attr]


def kill_session(sid: int, passes: int = 50) -> None:
    """SIGKILL every process of session `sid` (ninja gives each compiler a process group of its own, so a group
    kill misses them; the session, which ninja keeps, holds them all). Again until a pass finds none: a driver
    may fork its compiler between a pass's reading of /proc and its kill."""
    me = os.getpid()
    for _ in range(passes):
        found = False
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
                if int(fields[3]) == sid and fields[0] != "Z":
                    os.kill(int(entry.name), signal.SIGKILL)
                    found = True
            except (OSError, ValueError, IndexError):
                pass
        if not found:
            return
        time.sleep(0.01)


def _build_in_child() -> int:
    """The background build's child process: nice 19, and gone (with its compilers) when its parent is."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    except OSError:
        pass
    def stop(*_) -> None:  # the session's compilers first, then this process
        kill_session(os.getsid(0))
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    try:  # Linux: SIGTERM to this process when the parent dies, however it dies
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        return 1
    return 0 if _load_or_build(build=True) else 1


def unsupported(model: "LlamaForCausalLM") -> str | None:
    """Why this model cannot take the compiled path (None: it can)."""
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return "needs bfloat16 weights on the CPU"
    return None


class CpuDecode:
    """The model's weights gathered once into the lists the compiled forward takes."""

    def __init__(self, model: "LlamaForCausalLM", kv_caches: list["KVCache"]) -> None:
        self.model = model
        # The table, or the tied head's tiles where it was released (the forward looks rows up in the codes)
        self.embed = model.embed_tokens.weight if model.embed_tokens.weight.device.type != "meta" \
            else model.embed_codes.blocks
        self.cos_sin = model.rotary.cos_sin_cache
        self.norms, self.weights, self.planes, self.bits = [], [], [], []
        self.tails = []  # per projection: its tiles' tail (TiledCodes.tail), or an empty tensor
        code_on = enabled(CODE_KERNEL_SWITCH)
        none = torch.empty(0, dtype=torch.uint8)
        for layer in model.layers:
            self.norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: 6 norms a layer
                self.norms += [layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight]
            if layer.self_attn.q_norm is not None:  # Qwen3: 4 norms a layer
                self.norms += [layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight]
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                packed = linear.packed if linear.packed is not None else torch.empty(0, dtype=model.dtype)
                if linear.int4 is None:  # a float weight (F16, BF16 or F32 in the file): planes 0, the weight itself
                    dense = linear.weight if linear.weight.device.type != "meta" else none
                    self.weights += [none, dense, packed, none]
                    self.planes.append(0)
                    self.bits.append(0)
                    self.tails.append(none)
                    continue
                tiles = linear.int4.tiles if code_on else None
                # torch's int4 pack is read only where there are no tiles (the model may release it: release_int4_packs)
                int4 = (linear.int4.packed, linear.int4.scales_and_zeros) if tiles is None else (none, none)
                self.weights += [*int4, packed, tiles.blocks if tiles is not None else none]
                self.planes.append(linear.int4.planes)
                self.bits.append(tiles.bits if tiles is not None else 0)
                self.tails.append(tiles.tail.blocks if tiles is not None and tiles.tail is not None else none)
        self.norms.append(model.norm.weight)
        # Qwen2's q/k/v biases, one [q + k + v] vector a layer (none: an empty list)
        self.qkv_bias = [layer.self_attn.qkv_proj.bias for layer in model.layers] if model.shape.qkv_bias else []
        self.kv = [t for pair in kv_caches for t in pair]
        shape = model.shape
        # Past code_max_rows() a projection with a oneDNN copy takes it; one without takes the code kernel (with int8
        # activations from int8_min_rows() rows), or from dequantize_min_rows() rows its dequantized scratch and
        # oneDNN's GEMM (AVX-512: cpu_code_dequantize.h).
        self.dims = (shape.num_heads, shape.num_kv_heads, shape.head_dim, float(shape.rms_norm_eps), INT4_MAX_ROWS,
                     code_max_rows(), dequantize_min_rows(), int8_min_rows())
        # Gemma 3: the sliding layers (their window and RoPE table), the query scale, the embeddings' scale
        local = model.rotary_local
        sliding = [int(layer.self_attn.sliding) for layer in model.layers] if local is not None else []
        self.family_args = (local.cos_sin_cache if local is not None else torch.empty(0), sliding,
                            int(shape.sliding_window or 0) if sliding else 0,
                            float(model.layers[0].self_attn.scale) if shape.query_pre_attn_scalar else 0.0,
                            float(model.embed_scale) if model.embed_scale is not None else 0.0)
        # Past INT4_MAX_ROWS the projections take the oneDNN copies, or the code kernel where there are none:
        # only when every projection has one or the other.
        self.packed = all(w.numel() or bits or not planes
                          for w, bits, planes in zip(self.weights[2::4], self.bits, self.planes))
        self.max_rows = MAX_ROWS if self.packed else INT4_MAX_ROWS
        self.mixed = enabled(MIXED_SWITCH)

    def can_run(self, num_tokens: int, decode_only: bool) -> bool:
        if decode_only:
            return num_tokens <= self.max_rows and is_loaded()
        # An iteration with a prefill chunk, of any size past INT4_MAX_ROWS when the oneDNN copies are there.
        return self.mixed and (self.packed or num_tokens <= INT4_MAX_ROWS) and is_loaded()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [rows, hidden] (bfloat16) of one iteration, KV written."""
        return ops().forward(
            input_ids, positions, slot_mapping, block_tables.contiguous(), seq_lens, query_start_loc, self.embed,
            self.cos_sin, self.norms, self.weights, self.planes, self.bits, self.kv, *self.dims, *self.family_args,
            self.qkv_bias, self.tails)


if __name__ == "__main__":  # the background build's child (_build_quietly)
    logging.basicConfig(level=logging.WARNING)  # a failed compile's warning; the parent logs the success
    sys.exit(_build_in_child())
