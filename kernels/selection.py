"""Backend selection: flashinfer, then Triton on CUDA; the torch reference on the CPU."""
from __future__ import annotations

import torch

from stallfree.kernels.attention import AttentionBackend

KNOWN_BACKENDS = ("auto", "torch", "triton", "flashinfer")


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    if name not in KNOWN_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(KNOWN_BACKENDS)}")
    if name == "auto":
        name = "torch" if device.type != "cuda" else _best_cuda_backend()
    if name == "torch":
        from stallfree.kernels.torch_reference import TorchReferenceBackend

        return TorchReferenceBackend()
    if name == "triton":
        from stallfree.kernels.triton_attention import TritonBackend

        return TritonBackend()
    from stallfree.kernels.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(device)


def _best_cuda_backend() -> str:
    try:
        import flashinfer  # noqa: F401

        return "flashinfer"
    except ImportError:
        return "triton"
