"""Model configuration: which weights to load, onto which device, in which dtype and attention backend."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    # A shape name from stallfree.shapes (common/shapes.py: random weights), "smollm2-135m" (the embedded GGUF),
    # "random:<shape>", a HF folder or a .gguf path (loader.py).
    model: str = "smollm2-135m"
    device: str = "cpu"  # cpu | cuda | auto (cuda when present)
    # float32 | bfloat16 | float16 | auto (the CLIs' default; loader.resolve_dtype says what it picks)
    dtype: str = "float32"
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
    # oneDNN bfloat16 copies of the GGUF-coded projections for many-row iterations (AVX-512 only: models/cpu_tier.py):
    # "on", "off", or "auto": made while they hold at most DENSE_COPY_AUTO_BYTES (models/loader.py). Without them
    # many-row iterations dequantize the codes a projection at a time (models/cpu_code_dequantize.h).
    cpu_dense_copy: str = "auto"
