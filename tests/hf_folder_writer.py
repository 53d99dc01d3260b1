"""The inverse of models/hf_loader.py, for tests: a model written as a Hugging Face folder (config.json, safetensors
shards, and the index when sharded), as a checkpoint of each family the loader reads."""
from __future__ import annotations

import json
import os

import torch

from stallfree.node_daemon.models import hf_loader
from stallfree.node_daemon.models.llama import LlamaForCausalLM, is_sliding_layer
from stallfree.shapes import ModelShape


def save_hf_folder(model: LlamaForCausalLM, folder: str, max_shard_bytes: int = 2 << 30,
                   model_type: str = "llama", extra_config: dict | None = None) -> None:
    """Write the model as a Hugging Face folder (config.json + safetensors shards + index when sharded)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in model.hf_weights():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").clone()  # q/k/v are views of one fused tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = hf_loader.SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        with open(os.path.join(folder, hf_loader.INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**hf_config(model.shape, model_type, model.dtype), **(extra_config or {})}, f, indent=1)


def hf_config(shape: ModelShape, model_type: str, dtype: torch.dtype) -> dict:
    architecture = {v: k for k, v in hf_loader._ARCHITECTURES.items()}[model_type]
    config = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings, "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_norm_eps, "tie_word_embeddings": shape.tie_word_embeddings,
        "rope_scaling": shape.rope_scaling, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if shape.qkv_bias != (model_type == "qwen2"):
        raise ValueError(f"a {model_type} checkpoint cannot carry qkv_bias={shape.qkv_bias}")
    if shape.family != hf_loader._FAMILIES.get(model_type, "llama"):
        raise ValueError(f"a {model_type} checkpoint cannot hold a model of the {shape.family} family")
    if shape.family == "gemma3":
        config.update({
            "sliding_window": shape.sliding_window, "sliding_window_pattern": shape.sliding_window_pattern or 1,
            "layer_types": ["sliding_attention" if is_sliding_layer(shape, i) else "full_attention"
                            for i in range(shape.num_layers)],
            "rope_local_base_freq": shape.rope_local_theta,
            "query_pre_attn_scalar": _int_if_whole(shape.query_pre_attn_scalar),
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        })
    return config


def _int_if_whole(value: float | None) -> float | int | None:
    """Transformers' Gemma3TextConfig takes query_pre_attn_scalar as an int."""
    return int(value) if value is not None and float(value).is_integer() else value
