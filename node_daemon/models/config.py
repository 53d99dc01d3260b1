"""Model configuration: which weights to load, onto which device, in which dtype and attention backend."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    # A name from models/shapes.py (random weights), "smollm2-135m" (embedded GGUF), a HF folder or a .gguf path.
    model: str = "smollm2-135m"
    device: str = "cpu"
    dtype: str = "float32"  # the CLIs default to auto: bfloat16 on CPUs with AVX512-BF16/AMX and on CUDA
    attention_backend: str = "auto"  # auto | cpu | torch | triton | flashinfer
    # torch CPU threads: None leaves torch as it is; 0 takes the cores given (affinity, cgroup quota).
    threads: int | None = None
    max_model_len: int | None = None  # None: the model's own context
    seed: int = 0
    # The compiled decode-only forward (models/cpu_decode.py) on the CPU: "off"; "background": loaded from its
    # cache, else compiled on a low-priority thread while the Python path serves; "now": compiled here if needed.
    compiled_decode: str = "off"
    # Free each projection's plain dense weight once it is prepacked for oneDNN (CPU bfloat16): held once per
    # layout served. Off keeps hf_weights/load_weights usable (tests, export).
    release_dense_weights: bool = False
