"""Attention backend selection: automatic choice per device, explicit override, clear refusals."""
from __future__ import annotations

import pytest
import torch

from stallfree.kernels import selection
from stallfree.kernels.attention import select_backend
from stallfree.kernels.cpu_attention import CpuAttentionBackend
from stallfree.kernels.torch_reference import TorchReferenceBackend

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def test_auto_is_the_cpu_backend_on_the_cpu_and_torch_stays_selectable():
    assert selection.resolve_backend_name("auto", CPU) == "cpu"
    assert isinstance(select_backend("auto", "cpu"), CpuAttentionBackend)
    assert isinstance(select_backend("torch", "cpu"), TorchReferenceBackend)


def test_the_cpu_backend_is_refused_on_cuda():
    with pytest.raises(ValueError, match="runs on the CPU only"):
        selection.resolve_backend_name("cpu", CUDA)


def test_auto_on_cuda_prefers_flashinfer_then_triton():
    assert selection.resolve_backend_name("auto", CUDA, flashinfer_ok=True) == "flashinfer"
    assert selection.resolve_backend_name("auto", CUDA, flashinfer_ok=False) == "triton"


def test_auto_on_cuda_probes_flashinfer(monkeypatch):
    seen = []
    monkeypatch.setattr(selection, "flashinfer_usable", lambda device: seen.append(device) or False)
    assert selection.resolve_backend_name("auto", CUDA) == "triton"
    assert seen == [CUDA]


@pytest.mark.parametrize("name", ["torch", "triton", "flashinfer"])
def test_explicit_names_are_honoured_on_cuda(name):
    # An explicit choice never consults the probe: flashinfer_ok=False must not demote it.
    assert selection.resolve_backend_name(name, CUDA, flashinfer_ok=False) == name


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="auto, cpu, torch, triton, flashinfer"):
        selection.resolve_backend_name("xformers", CPU)


def test_flashinfer_on_the_cpu_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("flashinfer", "cpu")


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        selection.resolve_backend_name("triton", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert selection.resolve_backend_name("triton", CPU) == "triton"


def test_flashinfer_is_not_usable_without_the_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_flashinfer(name, *args, **kwargs):
        if name == "flashinfer" or name.startswith("flashinfer."):
            raise ImportError("No module named 'flashinfer'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flashinfer)
    assert selection.flashinfer_usable(CUDA) is False


def test_graph_capable_backends_say_so():
    from stallfree.kernels.triton_attention import TritonBackend

    assert TritonBackend.supports_cuda_graphs is True
    # The torch reference loops over host lists: a captured graph would replay stale lengths.
    assert not getattr(TorchReferenceBackend, "supports_cuda_graphs", False)
    assert not CpuAttentionBackend.supports_cuda_graphs
