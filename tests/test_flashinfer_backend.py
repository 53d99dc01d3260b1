"""FlashInferBackend's planning on the CPU, against a stand-in for flashinfer's wrapper that records calls:
one plan per iteration over the whole mixed batch, every layer reusing it, the workspace shared, and the
fixed-buffer wrappers of CUDA-graph mode planned at begin_iteration."""
from __future__ import annotations

import torch
import pytest

from stallfree.kernels.attention import AttentionMetadata
from stallfree.kernels.flashinfer_backend import FlashInferBackend


class RecordingWrapper:
    instances: list["RecordingWrapper"] = []

    def __init__(self, workspace, layout, use_cuda_graph=False, backend="auto", **buffers):  # flashinfer's defaults
        self.workspace, self.layout, self.use_cuda_graph, self.backend = workspace, layout, use_cuda_graph, backend
        self.buffers = buffers
        self.plans: list[tuple] = []
        self.runs = 0
        RecordingWrapper.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             **kwargs):
        self.plans.append((qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.tolist(), last_page_len.tolist(),
                           num_qo_heads, num_kv_heads, head_dim, page_size, kwargs))

    def run(self, q, kv):
        self.runs += 1
        assert self.plans, "run before plan"
        return torch.zeros_like(q)


class FakeFlashinfer:
    BatchPrefillWithPagedKVCacheWrapper = RecordingWrapper


@pytest.fixture
def backend():
    RecordingWrapper.instances = []
    return FlashInferBackend("cpu", workspace_bytes=1024, kernel_backend="fa2", flashinfer_module=FakeFlashinfer)


def mixed_metadata() -> AttentionMetadata:
    # A decode over 20 cached tokens, then a 5-token chunk over 12 cached tokens; pages of 16.
    tables = torch.tensor([[7, 3, 0], [4, 9, 0]], dtype=torch.int32)
    return AttentionMetadata(torch.tensor([0, 1, 6], dtype=torch.int32), torch.tensor([21, 17], dtype=torch.int32),
                             tables, torch.arange(6), 5, 21, [1, 5], [21, 17], 16)


def layer_inputs(dtype=torch.bfloat16):
    q = torch.zeros(6, 8, 64, dtype=dtype)
    cache = torch.zeros(12, 16, 2, 64, dtype=dtype)
    return q, cache, cache


def test_one_plan_per_iteration_reused_by_every_layer(backend):
    md = mixed_metadata()
    backend.begin_iteration(md)
    for _ in range(4):  # four layers
        backend.forward(*layer_inputs(), md, 0.125)
    wrapper = RecordingWrapper.instances[0]
    assert wrapper.layout == "NHD" and wrapper.backend == "fa2" and not wrapper.use_cuda_graph
    assert wrapper.runs == 4 and len(wrapper.plans) == 1
    qo, kv_indptr, kv_indices, last, heads, kv_heads, head_dim, page, kwargs = wrapper.plans[0]
    assert qo == [0, 1, 6] and kv_indptr == [0, 2, 4] and kv_indices == [7, 3, 4, 9] and last == [5, 1]
    assert (heads, kv_heads, head_dim, page) == (8, 2, 64, 16)
    assert kwargs["causal"] is True and kwargs["sm_scale"] == 0.125
    assert kwargs["q_data_type"] == kwargs["kv_data_type"] == torch.bfloat16
    # The next iteration plans again, on the same workspace.
    md2 = mixed_metadata()
    backend.begin_iteration(md2)
    backend.forward(*layer_inputs(), md2, 0.125)
    assert len(wrapper.plans) == 2 and len(RecordingWrapper.instances) == 1


def test_forward_needs_this_iterations_plan(backend):
    backend.begin_iteration(mixed_metadata())
    with pytest.raises(RuntimeError, match="begin_iteration"):
        backend.forward(*layer_inputs(), mixed_metadata(), 0.125)


def test_graph_mode_plans_fixed_buffer_wrappers_at_begin_iteration(backend):
    md = mixed_metadata()
    with pytest.raises(RuntimeError, match="eager iteration first"):
        backend.use_cuda_graph_batch(2, max_pages_per_seq=3)
        backend.begin_iteration(md)
    backend.use_cuda_graph_batch(None)
    backend.begin_iteration(md)
    backend.forward(*layer_inputs(), md, 0.125)  # the eager step that teaches the problem shape
    eager = RecordingWrapper.instances[0]

    backend.use_cuda_graph_batch(2, max_pages_per_seq=3)
    backend.begin_iteration(md)  # plans at once: a replay never calls forward()
    graph = RecordingWrapper.instances[1]
    assert graph.use_cuda_graph and graph.workspace is eager.workspace
    assert graph.buffers["qo_indptr_buf"].shape == (3,) and graph.buffers["paged_kv_indices_buf"].shape == (6,)
    assert len(graph.plans) == 1 and graph.plans[0][4:8] == (8, 2, 64, 16)
    backend.forward(*layer_inputs(), md, 0.125)  # under capture: the graph wrapper runs, no new plan
    assert graph.runs == 1 and len(graph.plans) == 1 and eager.runs == 1
    backend.use_cuda_graph_batch(2, max_pages_per_seq=3)
    backend.begin_iteration(md)
    assert len(RecordingWrapper.instances) == 2  # one wrapper per bucket, reused
    backend.use_cuda_graph_batch(None)


@pytest.mark.parametrize("pin,want", [(None, "auto"), ("fa2", "fa2"), ("fa3", "fa3")])
def test_kernel_family_reaches_the_eager_and_graph_wrappers(monkeypatch, pin, want):
    """Built as select_backend builds it (no kernel_backend): the env pin, or auto, reaches both wrappers."""
    RecordingWrapper.instances = []
    if pin is None:
        monkeypatch.delenv("STALLFREE_FLASHINFER_BACKEND", raising=False)
    else:
        monkeypatch.setenv("STALLFREE_FLASHINFER_BACKEND", pin)
    backend = FlashInferBackend("cpu", workspace_bytes=1024, flashinfer_module=FakeFlashinfer)
    md = mixed_metadata()
    backend.begin_iteration(md)
    backend.forward(*layer_inputs(), md, 0.125)
    backend.use_cuda_graph_batch(2, max_pages_per_seq=3)
    backend.begin_iteration(md)
    assert [w.backend for w in RecordingWrapper.instances] == [want, want]


def test_unknown_kernel_family_is_refused_at_construction(monkeypatch):
    monkeypatch.setenv("STALLFREE_FLASHINFER_BACKEND", "fa4")
    with pytest.raises(ValueError, match="fa4"):
        FlashInferBackend("cpu", workspace_bytes=1024, flashinfer_module=FakeFlashinfer)


def test_the_calls_the_fake_records_fit_flashinfers_real_signatures():
    """Every constructor and plan() call this backend makes binds to the installed flashinfer's signatures."""
    import inspect

    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python not installed (the gpu extra)")
    real = flashinfer.BatchPrefillWithPagedKVCacheWrapper

    class Checked(RecordingWrapper):
        def __init__(self, *args, **kwargs):
            inspect.signature(real.__init__).bind(None, *args, **kwargs)
            super().__init__(*args, **kwargs)

        def plan(self, *args, **kwargs):
            inspect.signature(real.plan).bind(None, *args, **kwargs)
            super().plan(*args, **kwargs)

    class CheckedFlashinfer:
        BatchPrefillWithPagedKVCacheWrapper = Checked

    RecordingWrapper.instances = []
    backend = FlashInferBackend("cpu", workspace_bytes=1024, flashinfer_module=CheckedFlashinfer)
    md = mixed_metadata()
    backend.begin_iteration(md)
    backend.forward(*layer_inputs(), md, 0.125)
    backend.use_cuda_graph_batch(2, max_pages_per_seq=3)
    backend.begin_iteration(md)
    assert len(RecordingWrapper.instances) == 2 and all(w.plans for w in RecordingWrapper.instances)


def test_cpu_device_is_refused_without_an_injected_module():
    with pytest.raises(ValueError, match="CUDA devices only"):
        FlashInferBackend("cpu")
