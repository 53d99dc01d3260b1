"""Run flashinfer's own Python planning on the CPU: stub only the two things that need CUDA.

1. Its wrappers allocate a pinned host buffer (torch.empty(pin_memory=True)), which a CPU-only torch refuses:
   without CUDA the pin is dropped.
2. plan() builds (JIT) or loads a compiled module for the chosen kernel family and calls its plan(); that
   needs a GPU arch. The stub records the family and the host metadata flashinfer computed and handed to
   it (qo_indptr, kv_indptr, kv lengths, rows, batch size, heads, page size, causal).

run() would launch the CUDA kernel: `attend_as_flashinfer` computes, in float64, the attention the wrapper's
planned CSR buffers describe, read the way flashinfer reads them (pages kv_indices[kv_indptr[i]:kv_indptr[i+1]],
last page kv_last_page_len[i] long, bottom-right causal).
"""
from __future__ import annotations

import pytest
import torch


class ModuleRecorder:
    """Stands in for the compiled batch-prefill module flashinfer would load for a kernel family."""

    def __init__(self) -> None:
        self.families: list[str] = []
        self.plans: list[tuple] = []

    def get_module(self, backend, *args):
        self.families.append(backend)
        recorder = self

        class Module:
            @staticmethod
            def plan(*plan_args):
                recorder.plans.append(plan_args)
                return ("plan-info", len(recorder.plans))

        return Module()

    def host_metadata(self, i: int = -1) -> dict:
        """The figures flashinfer's plan() passed its module (argument order of flashinfer 0.7's FA2/FA3 plan)."""
        a = self.plans[i]
        return {"qo_indptr": a[3].tolist(), "kv_indptr": a[4].tolist(), "kv_lens": a[5].tolist(),
                "total_rows": a[6], "batch_size": a[7], "num_qo_heads": a[8], "num_kv_heads": a[9],
                "page_size": a[10], "cuda_graph": a[11], "head_dim": a[12], "causal": a[14]}


@pytest.fixture
def cpu_flashinfer(monkeypatch):
    """(flashinfer, ModuleRecorder) with the CUDA-only pieces stubbed; skips where flashinfer is not installed."""
    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python not installed (the gpu extra)")
    import flashinfer.prefill as prefill

    if not torch.cuda.is_available():
        real_empty = torch.empty

        def empty_unpinned(*args, pin_memory=False, **kwargs):
            return real_empty(*args, **kwargs)

        monkeypatch.setattr(torch, "empty", empty_unpinned)
    recorder = ModuleRecorder()
    monkeypatch.setattr(prefill, "get_batch_prefill_module", recorder.get_module)
    return flashinfer, recorder


def attend_as_flashinfer(wrapper, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """float64 attention over the wrapper's planned buffers, NHD cache [pages, page_size, kv_heads, dim]."""
    qo = wrapper._qo_indptr_buf.tolist()
    kv_indptr = wrapper._paged_kv_indptr_buf.tolist()
    indices = wrapper._paged_kv_indices_buf
    last = wrapper._paged_kv_last_page_len_buf.tolist()
    page_size = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i in range(len(qo) - 1):
        pages = indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        kv_len = max(0, len(pages) - 1) * page_size + last[i]
        k = k_cache[pages].flatten(0, 1)[:kv_len].double().repeat_interleave(group, dim=1)
        v = v_cache[pages].flatten(0, 1)[:kv_len].double().repeat_interleave(group, dim=1)
        q = query[qo[i]:qo[i + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * wrapper._sm_scale
        if wrapper._causal:  # bottom-right: query j of the chunk sees keys up to kv_len - q_len + j
            q_pos = torch.arange(q.shape[0]) + kv_len - q.shape[0]
            scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos[:, None], float("-inf"))
        out[qo[i]:qo[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
