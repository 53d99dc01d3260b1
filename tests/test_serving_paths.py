"""A slow path is never silent: a GGUF file's matrices that no code kernel serves and a Python forward are named
(models/serving_paths.py), exposed in /metrics (stallfree_slow_path) and /admin/stats (WindowStats.slow_paths), and
become the InferenceService's ServingPath condition, through /admin/stats and through Prometheus alike."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from prometheus_client import generate_latest

from control_helpers import observation, stats
from stallfree.contracts import WindowStats
from stallfree.node_daemon.models.gguf_file import GGUFFile
from stallfree.node_daemon.models.gguf_loader import _dequantized_types
from stallfree.node_daemon.models.llama import LlamaForCausalLM
from stallfree.node_daemon.models.loader import LoadedModel
from stallfree.node_daemon.models.random_weights import tiny_family_shape
from stallfree.node_daemon.models.serving_paths import slow_paths
from stallfree.node_daemon.server.metrics import EngineMetrics
from stallfree.operator.control.loop import serving_path_condition
from stallfree.operator.control.observe_prometheus import window_queries


def _file_with(path: str, tensors: dict[str, tuple[str, int, int]]) -> str:
    """A GGUF file of raw blocks: name -> (type, rows, columns), random codes under small float16 scales."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    for name, (kind, rows, cols) in tensors.items():
        qtype = gguf.GGMLQuantizationType[kind]
        weights, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // weights * size), dtype=np.uint8)
        writer.add_tensor(name, raw, raw_shape=(rows, cols // weights * size), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_matrices_no_code_kernel_serves_are_counted_by_type(tmp_path):
    path = _file_with(str(tmp_path / "mixed.gguf"), {
        "blk.0.attn_q.weight": ("Q5_0", 64, 640),  # served from its codes
        "blk.0.ffn_down.weight": ("IQ2_XXS", 64, 512),  # no code kernel
        "blk.1.ffn_down.weight": ("IQ2_XXS", 64, 512),
        "blk.0.attn_k.weight": ("IQ3_XXS", 64, 256),
        "blk.1.attn_k.weight": ("Q3_K", 64, 256),  # served from its codes (8-bit)
        "blk.1.attn_q.weight": ("Q2_K", 64, 512),
        "output_norm.weight": ("F32", 1, 64),  # a vector
        "blk.0.attn_v.weight": ("F16", 64, 64),  # a float weight, served as itself
    })
    assert _dequantized_types(GGUFFile(path), int4=True) == {"IQ2_XXS": 2, "IQ3_XXS": 1}
    assert _dequantized_types(GGUFFile(path), int4=False) == {}  # float32 or CUDA: no codes at all


def _loaded(dequantized: dict[str, int]) -> LoadedModel:
    shape = tiny_family_shape("qwen3")
    model = LlamaForCausalLM(shape, torch.bfloat16, "meta")
    return LoadedModel(model=model, shape=shape, eos_token_ids=(), bos_token_id=None, max_model_len=64,
                       source=None, source_kind="gguf", dequantized=dequantized)


def test_each_slow_path_is_one_line_and_the_fast_path_none():
    assert slow_paths(_loaded({}), compiled=True, why_not_compiled=None) == []
    lines = slow_paths(_loaded({"IQ2_XXS": 28}), compiled=False, why_not_compiled="no C++ compiler (c++) on PATH")
    assert lines == ["forward: python (no C++ compiler (c++) on PATH)",
                     "weights: 28 IQ2_XXS matrices dequantized to bfloat16 (no code kernel for IQ2_XXS at their width)"]


def test_slow_paths_reach_metrics_and_the_stats_the_operator_reads():
    metrics = EngineMetrics("m")
    metrics.set_slow_paths(["forward: python (compiling)", "weights: 2 IQ2_XXS matrices dequantized"])
    text = generate_latest(metrics.registry).decode()
    assert 'stallfree_slow_path{model_name="m",path="forward: python (compiling)"} 1.0' in text
    metrics.set_slow_paths([])  # the compile loaded: the series go, not to 0
    assert "stallfree_slow_path{" not in generate_latest(metrics.registry).decode()
    window = replace(stats(), slow_paths=("weights: 2 IQ2_XXS matrices dequantized",))
    assert WindowStats.from_dict(window.to_dict()) == window
    old_daemon = stats().to_dict()
    del old_daemon["slow_paths"]
    assert WindowStats.from_dict(old_daemon).slow_paths == ()


def test_the_serving_path_condition_names_each_slow_replica():
    slow = replace(stats(), slow_paths=("forward: python (no C++ compiler (c++) on PATH)",))
    condition = serving_path_condition([observation("a", stats()), observation("b", slow)])
    assert (condition.status, condition.reason) == ("False", "SlowPath")
    assert condition.message == "b: forward: python (no C++ compiler (c++) on PATH)"
    fast = serving_path_condition([observation("a", stats()), observation("b", stats())])
    assert (fast.status, fast.reason) == ("True", "FastPath")
    assert serving_path_condition([observation("a", None, unknown="down")]).status == "Unknown"
    # Through Prometheus: the series are counted per replica.
    assert "count by (pod) (stallfree_slow_path{" in window_queries('namespace="x"', 30, "pod")["slow_paths"]
