"""Named model shapes: the architecture figures of a Llama-family decoder, without weights or torch.

Random weights of a named shape serve benchmarks (like vLLM's dummy load), and the cost model reads
the same figures, so both agree on what "llama-3-8b" is.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    rope_scaling: dict | None = None  # e.g. Llama-3.1's {"rope_type": "llama3", "factor": 8.0, ...}
    # The decoder's family (node_daemon/models/llama.py): "llama" (Llama, Mistral, Qwen2), "qwen3" (per-head q/k
    # RMSNorm) or "gemma3" (q/k norms, four norms a layer, GELU-tanh, scaled embeddings, sliding-window layers).
    family: str = "llama"
    sliding_window: int | None = None  # gemma3: keys a sliding layer's query sees (its own included)
    sliding_window_pattern: int = 0  # gemma3: every Nth layer attends globally, the others through the window
    rope_local_theta: float | None = None  # gemma3: the sliding layers' RoPE base
    query_pre_attn_scalar: float | None = None  # gemma3: queries scaled by its -1/2 power (else head_dim's)

    @property
    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads * d) + 2 * h * (self.num_kv_heads * d) + (self.num_heads * d) * h
        mlp = 3 * h * i
        norms = {"qwen3": 2 * h + 2 * d, "gemma3": 4 * h + 2 * d}.get(self.family, 2 * h)
        per_layer = attn + mlp + norms
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + head + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def with_(self, **changes) -> "ModelShape":
        return replace(self, **changes)


SHAPES: dict[str, ModelShape] = {
    # Tiny enough for exhaustive CPU tests; GQA ratio 2 so grouped heads are exercised.
    "tiny": ModelShape("tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048),
    "smollm2-135m": ModelShape("smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                               max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3-8b": ModelShape("llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             max_position_embeddings=8192, rope_theta=500000.0),
    "mistral-7b": ModelShape("mistral-7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             max_position_embeddings=32768, rope_theta=1000000.0),
    "llama-3-70b": ModelShape("llama-3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                              num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                              max_position_embeddings=8192, rope_theta=500000.0),
    "qwen2-0.5b": ModelShape("qwen2-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                             max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                             tie_word_embeddings=True, qkv_bias=True),
}


# "random:<shape>" asks for random weights of a shape even where the bare name means a real model
# (smollm2-135m is the embedded GGUF; random:smollm2-135m is random weights of its shape).
RANDOM_PREFIX = "random:"


def get_shape(name: str) -> ModelShape:
    """A named shape; the random: prefix is accepted, since a shape is all it names."""
    try:
        return SHAPES[name.lower().removeprefix(RANDOM_PREFIX)]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(sorted(SHAPES))}") from None
