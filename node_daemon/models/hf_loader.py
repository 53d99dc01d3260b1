"""Hugging Face model folders: config.json + safetensors (one file or shards with an index), read and written.

Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text, `gemma3_text`) checkpoints (and SmolLM2, which is a Llama). Tensors stream shard by shard
straight into the model's parameters, so peak memory is the model plus one tensor. The tokenizer files
(tokenizer.json, tokenizer_config.json with its chat template) stay in the folder for the tokenizer.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from stallfree.node_daemon.models.llama import LlamaForCausalLM
from stallfree.node_daemon.models.loader import LoadedModel, check_fits, resolve_max_model_len
from stallfree.shapes import ModelShape

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text"}
# The decoder family (ModelShape.family) of each model type
_FAMILIES = {"qwen3": "qwen3", "gemma3_text": "gemma3"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    with open(path) as f:
        return json.load(f)


def checkpoint_dtype(folder: str) -> str | None:
    """The dtype the checkpoint was saved in ("bfloat16", "float16", ...), if config.json says."""
    config = read_config(folder)
    return config.get("torch_dtype") or config.get("dtype")


def hf_shape(config: dict, name: str) -> ModelShape:
    """The ModelShape a config.json describes; ValueError for what we cannot run."""
    model_type = config.get("model_type") or next(
        (_ARCHITECTURES[a] for a in config.get("architectures", ()) if a in _ARCHITECTURES), None)
    if model_type == "gemma3":
        raise ValueError("model type 'gemma3' is Gemma 3's image-text checkpoint; its text model (gemma3_text, "
                         "Gemma3ForCausalLM) is supported")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("Llama checkpoints with attention_bias or mlp_bias are not supported")
    family = _FAMILIES.get(model_type, "llama")
    hidden, num_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    context = int(config.get("max_position_embeddings", 4096))
    window = config.get("sliding_window")
    gemma = _gemma3_fields(config, int(config["num_hidden_layers"])) if family == "gemma3" else {}
    if family != "gemma3" and window and config.get("use_sliding_window", model_type == "mistral"):
        # Attention here is always full; within one window full and sliding attention agree exactly.
        context = min(context, int(window))
    return ModelShape(
        name=name,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        max_position_embeddings=context,
        rope_theta=_rope_theta(config, "full_attention", 10000.0),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", family == "gemma3")),
        qkv_bias=model_type == "qwen2",
        rope_scaling=_rope_scaling(config),
        family=family,
        **gemma,
    )


def _rope_parameters(config: dict, layer_type: str) -> dict:
    """Transformers 5 writes RoPE as rope_parameters: one dict, or one per layer type (Gemma 3)."""
    params = config.get("rope_parameters") or {}
    nested = params.get(layer_type)
    return nested if isinstance(nested, dict) else params


def _rope_theta(config: dict, layer_type: str, default: float) -> float:
    theta = _rope_parameters(config, layer_type).get("rope_theta")
    return float(theta if theta is not None else config.get("rope_theta", default))


def _rope_scaling(config: dict) -> dict | None:
    """The global layers' scaling: rope_scaling, or a rope_parameters of a type other than default."""
    if config.get("rope_scaling"):
        return config["rope_scaling"]
    params = _rope_parameters(config, "full_attention")
    return dict(params) if params.get("rope_type", "default") != "default" else None


def _gemma3_fields(config: dict, layers: int) -> dict:
    """Gemma 3's sliding-window layout, local RoPE base and query scale; ValueError for what the forward lacks."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise ValueError(f"Gemma 3 checkpoints with {key} are not supported")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 with hidden_activation {activation!r} is not supported (gelu_pytorch_tanh is)")
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
    layer_types = config.get("layer_types")
    if layer_types:  # transformers 5 lists every layer; the forward knows the every-Nth-global layout
        globals_at = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
        pattern = globals_at[0] + 1 if globals_at else layers + 1
        expected = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        if list(layer_types) != expected:
            raise ValueError("Gemma 3 layer_types must have every Nth layer full_attention and the others "
                             "sliding_attention")
    window = config.get("sliding_window")
    return {
        "sliding_window": int(window) if window else None,
        "sliding_window_pattern": pattern,
        "rope_local_theta": float(_rope_parameters(config, "sliding_attention").get("rope_theta")
                                  or config.get("rope_local_base_freq", 10000.0)),
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar") or config.get("head_dim") or 256),
    }


def load_hf(folder: str, dtype: torch.dtype, device: torch.device, max_model_len: int | None = None) -> LoadedModel:
    config = read_config(folder)
    shape = hf_shape(config, os.path.basename(os.path.normpath(folder)))
    context = resolve_max_model_len(shape, max_model_len)
    check_fits(shape, dtype, device)
    model = LlamaForCausalLM(shape, dtype, device, context)
    model.load_weights(iter_safetensors(folder))
    return LoadedModel(model=model, shape=shape, eos_token_ids=_eos_token_ids(folder, config),
                       bos_token_id=config.get("bos_token_id"), max_model_len=context, source=folder,
                       source_kind="hf")


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight, shard by shard, each tensor read only when consumed."""
    from safetensors import safe_open

    for shard in safetensors_files(folder):
        with safe_open(shard, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, s) for s in shards]
    elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        files = [os.path.join(folder, SINGLE_FILE)]
    else:
        raise ValueError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"{folder}: the index names shards that are missing: {', '.join(map(os.path.basename, missing))}")
    return files


def _eos_token_ids(folder: str, config: dict) -> tuple[int, ...]:
    # generation_config.json often lists more stop ids (e.g. Llama-3's <|eot_id|>) than config.json.
    ids: list[int] = []
    sources = [config]
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f))
    for source in sources:
        eos = source.get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(dict.fromkeys(int(i) for i in ids))
