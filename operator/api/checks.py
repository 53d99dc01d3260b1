"""Checks a schema cannot express: does this spec describe a daemon that can exist?

The CRD's schema and CEL rules catch shapes and cross-field limits at admission. What they cannot
know (which models are embedded in the image, which shapes exist, whether a GPU device has a GPU)
is checked here, before anything is made. A problem becomes a status condition and an event on the
InferenceService, never a crash loop.
"""
from __future__ import annotations

import posixpath

from stallfree.shapes import SHAPES
from stallfree.operator.api.spec import InferenceServiceSpec

# Models shipped in the daemon image (the node daemon's loader knows them by these names).
EMBEDDED_MODELS = ("smollm2-135m",)
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")


def gpu_count(spec: InferenceServiceSpec) -> int:
    total = 0
    for name in GPU_RESOURCES:
        value = spec.resources.limits.get(name)
        if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
            total += int(value)
    return total


def problems(spec: InferenceServiceSpec) -> list[str]:
    """Every reason this spec cannot be deployed, in words a user can act on (empty: deployable)."""
    out: list[str] = []
    model = spec.model
    name = model.name.lower()
    if model.source == "embedded" and name not in EMBEDDED_MODELS:
        out.append(f"model.name {model.name!r} is not an embedded model (embedded: {', '.join(EMBEDDED_MODELS)}); "
                   "serve your own with source hf-folder or gguf")
    if model.source == "random" and name not in SHAPES:
        out.append(f"model.name {model.name!r} is not a known shape for random weights "
                   f"(known: {', '.join(sorted(SHAPES))})")
    if model.source in ("hf-folder", "gguf") and model.path is not None:
        if not posixpath.isabs(model.path):
            out.append(f"model.path {model.path!r} must be an absolute path inside the pod")
        elif model.volume is not None and not _under(model.path, model.mount_path):
            out.append(f"model.path {model.path!r} is not under model.mountPath {model.mount_path!r}, "
                       "where the model volume is mounted")
        if model.source == "gguf" and not model.path.endswith(".gguf"):
            out.append(f"model.path {model.path!r} must name a .gguf file for source gguf")
    shape = SHAPES.get(name) if model.source in ("embedded", "random") else None
    if shape is not None and model.max_model_len is not None and model.max_model_len > shape.max_position_embeddings:
        out.append(f"model.maxModelLen {model.max_model_len} exceeds {model.name}'s context of "
                   f"{shape.max_position_embeddings} tokens")

    engine = spec.engine
    gpus = gpu_count(spec)
    if engine.backend == "model" and engine.device == "cuda" and gpus == 0:
        out.append("engine.device is cuda but resources.limits asks for no GPU (set nvidia.com/gpu: 1)")
    if engine.backend == "model" and engine.attention_backend in ("triton", "flashinfer"):
        if engine.device == "cpu" or (engine.device == "auto" and gpus == 0):
            out.append(f"engine.attentionBackend {engine.attention_backend} needs a GPU; "
                       "use torch (or auto) on a CPU")
    return out


def _under(path: str, folder: str) -> bool:
    path, folder = posixpath.normpath(path), posixpath.normpath(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")
