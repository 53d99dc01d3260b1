"""Backend selection: flashinfer, then Triton on CUDA; the CPU backend on the CPU. Explicit names are honoured.

`auto` takes flashinfer only where it can run: the package imports and the GPU is Ampere or newer
(its FA2/FA3 kernels' floor). Otherwise Triton, which needs nothing beyond the triton package torch
already brings. An explicit name that cannot run on the device fails here, with the reason, rather
than at the first forward.
"""
from __future__ import annotations

import os

import torch

from stallfree.kernels.attention import AttentionBackend

KNOWN_BACKENDS = ("auto", "cpu", "torch", "triton", "flashinfer")
FLASHINFER_MIN_CAPABILITY = (8, 0)


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    resolved = resolve_backend_name(name, device)
    if resolved == "cpu":
        from stallfree.kernels.cpu_attention import CpuAttentionBackend

        return CpuAttentionBackend()
    if resolved == "torch":
        from stallfree.kernels.torch_reference import TorchReferenceBackend

        return TorchReferenceBackend()
    if resolved == "triton":
        from stallfree.kernels.triton_attention import TritonBackend

        return TritonBackend()
    from stallfree.kernels.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(device)


def resolve_backend_name(name: str, device: torch.device, flashinfer_ok: bool | None = None) -> str:
    """The backend `name` means on `device` (`flashinfer_ok` None: probe whether flashinfer can run there)."""
    if name not in KNOWN_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(KNOWN_BACKENDS)}")
    on_cuda = device.type == "cuda"
    if name == "auto":
        if not on_cuda:
            return "cpu"
        if flashinfer_ok is None:
            flashinfer_ok = flashinfer_usable(device)
        return "flashinfer" if flashinfer_ok else "triton"
    if name == "cpu" and on_cuda:
        raise ValueError("attention backend 'cpu' runs on the CPU only; use auto, flashinfer, triton or torch on CUDA")
    if name == "flashinfer" and not on_cuda:
        raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, not {device}; use torch or auto")
    if name == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend 'triton' needs a CUDA device, not {device} "
                         f"(TRITON_INTERPRET=1 runs it on the CPU, slowly, for tests); use torch or auto")
    return name


def flashinfer_usable(device: torch.device) -> bool:
    from stallfree.kernels.flashinfer_backend import import_flashinfer

    try:
        import_flashinfer()
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= FLASHINFER_MIN_CAPABILITY
