"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2, Qwen3, Gemma 3) over one flattened ragged batch.

A step's rows are the new tokens of every scheduled sequence laid end to end, no padding. Each layer
writes its keys and values into the paged KV cache at the step's slot mapping, then attends through
the block tables (AttentionMetadata) with the chosen AttentionBackend, so decodes and prefill chunks
over a cached prefix share one forward.

Parameters keep Hugging Face's names except two fusions: q/k/v -> `qkv_proj` and gate/up ->
`gate_up_proj` (one matmul each). `load_weights` takes Hugging Face names and slots them in;
`hf_weights` gives them back in Hugging Face names and shapes; `attach_int4` adds a GGUF checkpoint's
packed int4 weights beside the dense ones (models/quantized.py).

Qwen3 adds an RMSNorm over each head of q and k before RoPE. Gemma 3 adds those too, and: embeddings scaled
by sqrt(hidden_size), a GELU-tanh MLP, four norms a layer (the attention's and the MLP's outputs are normed before
they join the residual), queries scaled by query_pre_attn_scalar, and sliding-window layers (every
sliding_window_pattern-th layer global) with a RoPE base of their own. Gemma's norms multiply by (1 + weight): the
1 is folded into the weights here at load (load_weights; hf_weights gives it back), so every norm is the same op.

The residual stream runs as in vLLM: each layer takes (hidden, residual) and adds before it normalises,
so that on CUDA the add and the RMSNorm are one fused kernel (kernels/fused_ops.py). On the CPU under
half-precision layers the residual stream (and the RMSNorm weights) stay float32: thirty layers of
bfloat16 additions otherwise move logits by more than SmolLM2's margins (the France question's first
token is 0.08 logits from another), and the added cost is one cast per norm.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from stallfree.kernels.attention import AttentionBackend, AttentionMetadata
from stallfree.kernels.fused_ops import fused_add_rms_norm, rms_norm
from stallfree.node_daemon.models.layers import GeluTanhGLU, Linear, RMSNorm, SwiGLU, can_prepack, packed_linear, \
    prepack_weight
from stallfree.node_daemon.models.gguf_tiles import GgufBlocks, int4_of_parts
from stallfree.node_daemon.models.quantized import INT4_MAX_ROWS, BlockCodes, Int4Weight, TiledCodes
from stallfree.node_daemon.models.rope import RotaryEmbedding, apply_rope
from stallfree.node_daemon.models.sliding_window import windowed_attention
from stallfree.shapes import ModelShape

KVCache = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
FAMILIES = ("llama", "qwen3", "gemma3")  # ModelShape.family


QK_NORM_FAMILIES = ("qwen3", "gemma3")


def is_sliding_layer(shape: ModelShape, index: int) -> bool:
    """Gemma 3: every sliding_window_pattern-th layer (1-based) attends globally, the others through the window."""
    return shape.sliding_window_pattern > 0 and (index + 1) % shape.sliding_window_pattern != 0


class LlamaAttention(nn.Module):
    def __init__(self, shape: ModelShape, dtype: torch.dtype, device: torch.device | str,
                 norm_dtype: torch.dtype | None = None, sliding: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (shape.query_pre_attn_scalar or self.head_dim) ** -0.5
        # Qwen2 carries a bias on q, k and v (not on o).
        self.qkv_proj = Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, shape.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, shape.hidden_size, False, dtype, device)
        # Qwen3 and Gemma 3: each head of q and k RMS-normed before RoPE (weights [head_dim], shared by the heads).
        self.q_norm = self.k_norm = None
        if shape.family in QK_NORM_FAMILIES:
            self.q_norm = RMSNorm(self.head_dim, shape.rms_norm_eps, norm_dtype or dtype, device)
            self.k_norm = RMSNorm(self.head_dim, shape.rms_norm_eps, norm_dtype or dtype, device)
        # Gemma 3's sliding layers: RoPE of the local base, and keys limited to the last `window` positions.
        self.sliding = sliding
        self.window = shape.sliding_window if sliding else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = _head_norm(qk[:, :self.num_heads], self.q_norm)
            k = _head_norm(qk[:, self.num_heads:], self.k_norm)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # Q and K rotate together: one set of ops for both.
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        attn.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if self.window is not None and metadata.max_seq_len > self.window:
            out = windowed_attention(q, k_cache, v_cache, metadata, self.scale, self.window, attn)
        else:  # every key within the window: full causal attention is the same
            out = attn.forward(q, k_cache, v_cache, metadata, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


def _head_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """RMSNorm over head_dim of rows [n, heads, head_dim], in x's dtype."""
    n, heads, dim = x.shape
    return rms_norm(x.reshape(n * heads, dim), norm.weight, norm.eps).view(n, heads, dim)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, dtype: torch.dtype, device: torch.device | str,
                 residual_dtype: torch.dtype, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, residual_dtype, device)
        self.self_attn = LlamaAttention(shape, dtype, device, residual_dtype, is_sliding_layer(shape, index))
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, residual_dtype, device)
        self.mlp = SwiGLU(shape.hidden_size, shape.intermediate_size, dtype, device)

    def forward(self, h: torch.Tensor | None, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata, attn: AttentionBackend,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); their sum is the layer's output.
        The first layer gets h None and the embeddings as the residual."""
        x, residual = _input_norm(self.input_layernorm, h, residual, dtype)
        x = self.self_attn(x, cos, sin, kv_cache, metadata, attn)
        norm = self.post_attention_layernorm
        x, residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp(x), residual


def _input_norm(norm: RMSNorm, h: torch.Tensor | None, residual: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm: the first layer norms the embeddings (h None), the others add h to the residual first."""
    if h is None:
        return rms_norm(residual, norm.weight, norm.eps).to(dtype), residual
    return fused_add_rms_norm(h, residual, norm.weight, norm.eps)


class Gemma3DecoderLayer(nn.Module):
    """Gemma 3's layer: the attention's and the MLP's outputs are each normed again before they join the residual
    (post_attention_layernorm here is that output norm; pre_feedforward_layernorm the MLP's input norm)."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype, device: torch.device | str,
                 residual_dtype: torch.dtype, index: int = 0) -> None:
        super().__init__()
        hidden, eps = shape.hidden_size, shape.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, residual_dtype, device)
        self.self_attn = LlamaAttention(shape, dtype, device, residual_dtype, is_sliding_layer(shape, index))
        self.post_attention_layernorm = RMSNorm(hidden, eps, residual_dtype, device)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, residual_dtype, device)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, residual_dtype, device)
        self.mlp = GeluTanhGLU(hidden, shape.intermediate_size, dtype, device)

    def forward(self, h: torch.Tensor | None, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata, attn: AttentionBackend,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: (this layer's normed MLP output, the residual stream before it)."""
        x, residual = _input_norm(self.input_layernorm, h, residual, dtype)
        x = self.self_attn(x, cos, sin, kv_cache, metadata, attn)
        x = rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        norm = self.pre_feedforward_layernorm
        x, residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.mlp(x)
        return rms_norm(x, self.post_feedforward_layernorm.weight, self.post_feedforward_layernorm.eps), residual


class LlamaForCausalLM(nn.Module):
    """forward() gives final hidden states of every row; compute_logits() projects only the rows asked for."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.shape = shape
        self.dtype = dtype
        cpu_half = torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        self.residual_dtype = torch.float32 if cpu_half else dtype
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, dtype=dtype, device=device,
                                         _weight=torch.empty(shape.vocab_size, shape.hidden_size, dtype=dtype,
                                                             device=device))
        self.embed_tokens.weight.requires_grad_(False)
        if shape.family not in FAMILIES:
            raise ValueError(f"model family {shape.family!r} is not supported; supported: {', '.join(FAMILIES)}")
        layer_class = Gemma3DecoderLayer if shape.family == "gemma3" else LlamaDecoderLayer
        self.layers = nn.ModuleList(layer_class(shape, dtype, device, self.residual_dtype, i)
                                    for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, self.residual_dtype, device)
        self.lm_head = None if shape.tie_word_embeddings else Linear(shape.hidden_size, shape.vocab_size, False,
                                                                       dtype, device)
        self.rotary = RotaryEmbedding(shape.head_dim, max_positions or shape.max_position_embeddings,
                                      shape.rope_theta, shape.rope_scaling, device)
        # Gemma 3: the sliding layers' RoPE (its local base, no scaling) and the embeddings' scale, sqrt(hidden)
        # rounded to the embedding's dtype as Hugging Face's Gemma3TextScaledWordEmbedding rounds it.
        self.rotary_local = None
        self.embed_scale: torch.Tensor | None = None
        if shape.family == "gemma3":
            if any(layer.self_attn.sliding for layer in self.layers):
                self.rotary_local = RotaryEmbedding(shape.head_dim, max_positions or shape.max_position_embeddings,
                                                    shape.rope_local_theta or shape.rope_theta, None, device)
            self.embed_scale = torch.tensor(shape.hidden_size ** 0.5, dtype=dtype, device=device)
        # Tied embeddings: the output projection's int4 copy of the embedding matrix (GGUF), if any, and its
        # prepacked dense copy (prepack_for_cpu).
        self.tied_lm_head_int4: Int4Weight | None = None
        self.tied_lm_head_packed: torch.Tensor | None = None
        self.dense_released = False  # release_dense_weights() ran: the projections are served packed only
        # GGUF codes of projections whose other parts have not come yet (add_codes), by id(Linear)
        self._pending_codes: dict[int, tuple[Linear, list[tuple[str, slice, BlockCodes]]]] = {}
        # Whether the coded projections keep dense values for oneDNN copies (set by the GGUF loader)
        self.dense_copy_wanted = True

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device  # the embedding's table may be released (release_dense_embedding)

    @property
    def embed_codes(self) -> TiledCodes | None:
        """The embedding's code tiles where it has them (a tied head's): lookups take them once the dense table is
        released."""
        return self.tied_lm_head_int4.tiles if self.tied_lm_head_int4 is not None else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of input_ids in the model's dtype: the table's, else looked up in the codes."""
        if self.embed_tokens.weight.device.type != "meta":
            return self.embed_tokens(input_ids)
        return self.embed_codes.rows(input_ids).to(self.dtype)

    def release_dense_embedding(self) -> int:
        """Drop the dense embedding table where its codes serve both the lookups and the tied head (the compiled
        forward looks rows up in the tiles: models/cpu_code_matmul.h code_rows). Gemma 3 270M: 335 MB of 262k x 640
        bfloat16 beside the head's 189 MB of codes. Returns the bytes freed."""
        weight = self.embed_tokens.weight
        if self.embed_codes is None or self.lm_head is not None or weight.device.type == "meta":
            return 0
        self.embed_tokens.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
        self.dense_released = True
        return weight.numel() * weight.element_size()

    @property
    def graph_capturable(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph: not with sliding-window layers, whose attention
        chooses on the host, from the step's lengths, between the backend and windowed_attention's gathers."""
        return all(layer.self_attn.window is None for layer in self.layers)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final-norm hidden states [num_tokens, hidden_size]."""
        residual = self.embed(input_ids)
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        if residual.dtype != self.residual_dtype:
            residual = residual.to(self.residual_dtype)
        rope = self.rotary.lookup(positions)
        local = self.rotary_local.lookup(positions) if self.rotary_local is not None else rope
        h = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            cos, sin = local if layer.self_attn.sliding else rope
            h, residual = layer(h, residual, cos, sin, kv_cache, metadata, attn, self.dtype)
        return fused_add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows, hidden_size] -> float32 logits [rows, vocab_size]."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
            weight = self.lm_head.weight
        else:
            weight = self.embed_tokens.weight
            head = self.tied_lm_head_int4
            any_rows = self.tied_lm_head_packed is None
            if head is not None and hidden.shape[0] > 0 and head.code_kernel_applies(hidden.shape[0], any_rows):
                return head.matmul(hidden, float_out=True, any_rows=any_rows)  # the codes' float32 sums: exact
            if not hidden.shape[0]:
                return torch.empty(0, self.shape.vocab_size, dtype=torch.float32, device=hidden.device)
            if head is not None and (hidden.shape[0] <= INT4_MAX_ROWS or any_rows):
                logits = head.matmul(hidden)
            elif self.tied_lm_head_packed is not None:
                logits = packed_linear(hidden, self.tied_lm_head_packed, None)
            else:
                logits = F.linear(hidden, weight)
            if weight.device.type == "meta":  # released: the rows to refine come from the codes
                return _refine_top_logits(logits.float(), hidden, self.embed)
        if logits.dtype == torch.float32 or not logits.numel():
            return logits.float()
        return _refine_top_logits(logits.float(), hidden, lambda ids: weight.index_select(0, ids))

    def prepack_for_cpu(self, release: bool = False, coded: bool = True) -> bool:
        """Prepack every dense projection (and a tied output layer) for oneDNN when that pays (CPU, bfloat16);
        call once the weights are loaded. True if it did. `release`: release_dense_weights() one projection
        at a time as it is packed, so the two copies never coexist for the whole model (the load's peak RSS).
        `coded` False: only the projections without GGUF codes (the code kernel serves the others at every row
        count, with no copy beside the codes)."""
        if not can_prepack(torch.empty(0, dtype=self.dtype, device=self.device)):
            return False
        packed = 0
        for module in self.modules():
            if isinstance(module, Linear) and (coded or module.int4 is None) and \
                    (module.weight.device.type != "meta" or module.int4 is not None):
                module.prepack_for_cpu()
                packed += 1
                if release and module is not self.lm_head:
                    _release(module)
                    self.dense_released = True
        # A tied head with codes takes the code kernel at every row count (its rows are the sampling rows: few), so
        # no oneDNN copy of it (335 MB for Gemma 3 270M's 262k x 640).
        if self.lm_head is None and self.tied_lm_head_int4 is None:
            self.tied_lm_head_packed = prepack_weight(self.embed_tokens.weight)
            packed += 1
        return packed > 0

    def dense_copy_bytes(self) -> int:
        """What oneDNN copies of the coded projections would hold: bfloat16 weights (a coded tied head has none)."""
        weights = [m.weight for m in self.modules() if isinstance(m, Linear) and m.int4 is not None]
        return sum(w.numel() * 2 for w in weights)

    def int4_weights(self) -> list[Int4Weight]:
        """Every weight served from GGUF codes (the projections', the tied head's)."""
        found = [m.int4 for m in self.modules() if isinstance(m, Linear) and m.int4 is not None]
        return found + ([self.tied_lm_head_int4] if self.tied_lm_head_int4 is not None else [])

    def use_code_kernel(self, op, max_rows: int, dequantized=None, int8_min_rows: int = 0) -> None:
        """This model's quantized matmuls take the compiled code kernel `op` (up to `max_rows` rows where a oneDNN
        copy takes more; int8 activations from `int8_min_rows` rows, 0: never), or torch's int4 kernel with `op`
        None: per model, not per process. `dequantized`: (the library's dequantized_mm, from how many rows) for
        many-row matmuls without a oneDNN copy."""
        for weight in self.int4_weights():
            weight.code_kernel = None if op is None else (op, max_rows, int8_min_rows)
            weight.dequantized = None if op is None else dequantized

    @property
    def code_kernel_in_use(self) -> bool:
        return any(w.code_kernel is not None for w in self.int4_weights())

    def release_int4_packs(self) -> int:
        """Drop torch's int4 pack of every weight the code kernel serves (call once the compiled extension is
        loaded: each 4-bit weight is then held once, as the kernel's tiles). Returns the bytes freed."""
        return sum(w.release_int4_pack() for w in self.int4_weights())

    def release_coded_dense_weights(self) -> int:
        """Drop the plain dense copy of every projection served from its codes alone (tiers without oneDNN's
        bfloat16 GEMM: models/cpu_tier.py), as release_dense_weights does for prepacked ones. Returns the bytes freed."""
        freed = 0
        for module in self.modules():
            if isinstance(module, Linear) and module is not self.lm_head and module.int4 is not None \
                    and module.packed is None:
                freed += _release(module)
        self.dense_released = self.dense_released or freed > 0
        return freed

    def release_dense_weights(self) -> int:
        """Drop the plain dense copy of every projection that has a prepacked one: the serving path reads only
        the packed copy (and int4 for a few rows), so each weight is then held once per layout it is read in.
        The parameters stay as shapes without storage (meta); hf_weights and load_weights refuse from then on.
        The embedding and an untied lm_head keep theirs (lookups and the float32 logit refinement read them).
        Returns the bytes freed."""
        freed = 0
        for module in self.modules():
            if isinstance(module, Linear) and module is not self.lm_head and module.packed is not None:
                freed += _release(module)
        self.dense_released = self.dense_released or freed > 0
        return freed

    # --- int4 weights (GGUF) -------------------------------------------------------------------------

    def attach_int4(self, parts: dict[str, BlockCodes], dtype: torch.dtype) -> list[str]:
        """Pack every projection whose parts (q/k/v, gate/up) all came as codes; the names of the projections left
        dense (their parts were dequantized, or their row count does not suit)."""
        for name, codes in parts.items():
            self.add_codes(name, codes, dtype)
        self.unattached_codes()
        return self.dense_projections()

    def add_tiled_embedding(self, head: Int4Weight) -> None:
        """A tied embedding's codes, already tiled (the GGUF loader packs the largest matrix a slice at a time)."""
        if self.lm_head is not None:
            raise ValueError("add_tiled_embedding: this model's head is not tied")
        self.tied_lm_head_int4 = head

    def add_codes(self, name: str, codes: BlockCodes | GgufBlocks, dtype: torch.dtype) -> bool:
        """Take one GGUF tensor's codes (a Hugging Face name), decoded or still the file's bytes (GgufBlocks); a
        projection is packed as soon as all its parts (q/k/v, gate/up) have come, so a loader holds one layer's
        codes at a time. True once attached."""
        if name == "model.embed_tokens.weight":
            if isinstance(codes, GgufBlocks):
                codes = codes.decode()
            if self.lm_head is None and codes.rows % 16 == 0:
                self.tied_lm_head_int4 = Int4Weight(codes, dtype)
            return self.tied_lm_head_int4 is not None
        linear, rows = self._linear_of(name)
        if linear is None:
            return False
        pending = self._pending_codes.setdefault(id(linear), (linear, []))[1]
        pending.append((name, rows, codes))
        if sum(part.rows for _, _, part in pending) == linear.out_features:
            weight = int4_of_parts([(r, part) for _, r, part in pending], linear.out_features, dtype)
            if weight is not None:
                linear.int4 = weight
                del self._pending_codes[id(linear)]
                return True
        return False

    def unattached_codes(self) -> list[tuple[str, BlockCodes | GgufBlocks]]:
        """The parts add_codes could not attach (their projection's other parts were dequantized, or its rows do
        not suit): they are served dense. Clears them."""
        left = [(name, part) for _, parts in self._pending_codes.values() for name, _, part in parts]
        self._pending_codes.clear()
        return left

    def dense_projections(self) -> list[str]:
        dense = [n for n, m in self.named_modules() if isinstance(m, Linear) and m.int4 is None]
        if self.lm_head is None and self.tied_lm_head_int4 is None:
            dense.append("lm_head (tied)")
        return dense

    def _linear_of(self, name: str) -> tuple[Linear | None, slice]:
        """The Linear a Hugging Face weight name lives in, and its rows there (None for norms, biases)."""
        if name == "lm_head.weight":
            return self.lm_head, slice(0, self.lm_head.out_features if self.lm_head is not None else 0)
        m = _LAYER_NAME.fullmatch(name)
        if m is None or m["kind"] != "weight":
            return None, slice(None)
        layer = self.layers[int(m["layer"])]
        attn, mlp = layer.self_attn, layer.mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
        return {
            "self_attn.q_proj": (attn.qkv_proj, slice(0, q)),
            "self_attn.k_proj": (attn.qkv_proj, slice(q, q + kv)),
            "self_attn.v_proj": (attn.qkv_proj, slice(q + kv, q + 2 * kv)),
            "self_attn.o_proj": (attn.o_proj, slice(0, attn.o_proj.out_features)),
            "mlp.gate_proj": (mlp.gate_up_proj, slice(0, inter)),
            "mlp.up_proj": (mlp.gate_up_proj, slice(inter, 2 * inter)),
            "mlp.down_proj": (mlp.down_proj, slice(0, mlp.down_proj.out_features)),
        }.get(m["part"], (None, slice(None)))

    # --- weights in Hugging Face names -------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], served_by_codes: set[str] = frozenset()) -> None:
        """Copy Hugging Face-named tensors in (any dtype/device); raise if one is unknown, misshapen or missing.
        `served_by_codes`: projection weights that may be missing, their GGUF codes attached instead (add_codes)."""
        self._check_dense("load_weights")
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints still store a copy
            target, rows, key = self._locate(name)
            if tuple(target[rows].shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name}: expected shape {tuple(target[rows].shape)}, got {tuple(tensor.shape)}")
            shift = self._norm_shift(key)
            target[rows].copy_(tensor.float() + shift if shift else tensor)
            loaded.add(key)
        missing = [n for n in self._expected_keys() if n not in loaded and n not in served_by_codes]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:4])}")
        if self.tied_lm_head_packed is not None or any(isinstance(m, Linear) and m.packed is not None
                                                       for m in self.modules()):
            self.prepack_for_cpu()  # the packed copies must follow the new weights

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight under its Hugging Face name and shape (q/k/v and gate/up split back apart)."""
        self._check_dense("hf_weights")
        for key in self._expected_keys():
            target, rows, _ = self._locate(key)
            shift = self._norm_shift(key)
            yield key, (target[rows] - shift if shift else target[rows])

    def _norm_shift(self, key: str) -> float:
        """What the model adds to a checkpoint's norm weight: Gemma's (1 + weight), folded in at load."""
        return 1.0 if self.shape.family == "gemma3" and key.endswith("norm.weight") else 0.0

    def _check_dense(self, what: str) -> None:
        if self.dense_released:
            raise RuntimeError(f"{what}: this model's dense projection weights were released after prepacking "
                               f"(load it with release_dense_weights off)")

    def _expected_keys(self) -> list[str]:
        keys = ["model.embed_tokens.weight", "model.norm.weight"]
        if self.lm_head is not None:
            keys.append("lm_head.weight")
        per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight", "post_attention_layernorm.weight"]
        if self.shape.qkv_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if self.shape.family in QK_NORM_FAMILIES:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        if self.shape.family == "gemma3":
            per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
        for i in range(self.shape.num_layers):
            keys += [f"model.layers.{i}.{p}" for p in per_layer]
        return keys

    def _locate(self, name: str) -> tuple[torch.Tensor, slice, str]:
        """(parameter tensor, row slice within it, canonical key) for a Hugging Face weight name."""
        whole = slice(None)
        if name == "model.embed_tokens.weight":
            return self.embed_tokens.weight.data, whole, name
        if name == "model.norm.weight":
            return self.norm.weight.data, whole, name
        if name == "lm_head.weight" and self.lm_head is not None:
            return self.lm_head.weight.data, whole, name
        m = _LAYER_NAME.fullmatch(name)
        if m is None or int(m["layer"]) >= len(self.layers):
            raise ValueError(f"unexpected weight {name!r} for a Llama-family model of {self.shape.num_layers} layers")
        layer = self.layers[int(m["layer"])]
        part, kind = m["part"], m["kind"]
        attn, mlp = layer.self_attn, layer.mlp
        if part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            param = attn.qkv_proj.weight if kind == "weight" else attn.qkv_proj.bias
            if param is None:
                raise ValueError(f"unexpected weight {name!r}: this model has no qkv bias")
            q, kv = attn.q_size, attn.kv_size
            rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[part[-6]]
            return param.data, rows, name
        if kind != "weight":
            raise ValueError(f"unexpected weight {name!r}: only q/k/v projections carry a bias")
        inter = mlp.intermediate_size
        simple = {
            "self_attn.o_proj": (attn.o_proj.weight, whole),
            "mlp.gate_proj": (mlp.gate_up_proj.weight, slice(0, inter)),
            "mlp.up_proj": (mlp.gate_up_proj.weight, slice(inter, 2 * inter)),
            "mlp.down_proj": (mlp.down_proj.weight, whole),
            "input_layernorm": (layer.input_layernorm.weight, whole),
            "post_attention_layernorm": (layer.post_attention_layernorm.weight, whole),
        }
        if attn.q_norm is not None:
            simple.update({"self_attn.q_norm": (attn.q_norm.weight, whole),
                           "self_attn.k_norm": (attn.k_norm.weight, whole)})
        if isinstance(layer, Gemma3DecoderLayer):
            simple.update({"pre_feedforward_layernorm": (layer.pre_feedforward_layernorm.weight, whole),
                           "post_feedforward_layernorm": (layer.post_feedforward_layernorm.weight, whole)})
        if part not in simple:
            raise ValueError(f"unexpected weight {name!r}")
        param, rows = simple[part]
        return param.data, rows, name


def _release(linear: Linear) -> int:
    """Replace a Linear's dense weight by a storage-less one of the same shape; the bytes freed."""
    weight = linear.weight
    if weight.device.type == "meta":
        return 0
    linear.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
    return weight.numel() * weight.element_size()


# Half-precision logits are rounded to 8 significant bits (0.125 apart near 25): ties among the top
# candidates would decide greedy answers. The top few are recomputed in float32.
REFINED_LOGITS = 16


def _refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, rows_of) -> torch.Tensor:
    """logits [rows, vocab] float32 from a half-precision GEMM; the REFINED_LOGITS largest of each row redone
    as float32 dot products of hidden [rows, hidden_size] with their rows of the weight [vocab, hidden_size]
    (`rows_of(ids)`: the weight's rows, or the embedding's lookup in its codes)."""
    top = logits.topk(min(REFINED_LOGITS, logits.shape[-1]), dim=-1).indices  # [rows, k]
    rows = rows_of(top.view(-1)).view(*top.shape, -1).float()  # [rows, k, hidden]
    exact = torch.bmm(rows, hidden.float().unsqueeze(-1)).squeeze(-1)
    return logits.scatter_(1, top, exact)


_LAYER_NAME = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<part>[a-z_.]+?)\.(?P<kind>weight|bias)")
