"""Random weights of a named shape, reproducible from a seed (benchmarks and tests; like vLLM's dummy load).

Scales keep activations of order one through every layer (1/sqrt(fan_in) projections, unit
embeddings, unit norms), so logits are spread out and greedy choices are not near-ties: a random
model then exercises the same numerics as a trained one. Tests of the families' norms (Qwen3's per-head q/k norms,
Gemma's (1 + weight)) draw the norms around one too (`norm_std`), so a norm applied wrongly shows.
"""
from __future__ import annotations

import torch

from stallfree.node_daemon.models.llama import FAMILIES, LlamaForCausalLM
from stallfree.shapes import ModelShape


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int, norm_std: float = 0.0) -> None:
    """Draw every parameter in place on the model's own device (no host round trip for big shapes)."""
    device = model.device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            if norm_std:
                param.add_(torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32)
                           .mul_(norm_std).to(param.dtype))
        elif param.dim() == 1:  # qkv bias
            param.normal_(0.0, 0.1, generator=generator)
        elif name.startswith("embed_tokens"):
            param.normal_(0.0, 1.0, generator=generator)
        else:
            param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)


def tiny_family_shape(family: str, vocab_size: int = 512) -> ModelShape:
    """A test-sized shape of a family: Qwen3's (head_dim 64 and q width past hidden, as Qwen3-0.6B's 128 and 2048
    against 1024) or Gemma 3's (seven layers: the sixth global, the others sliding over a window of 8, head_dim past
    hidden / heads as Gemma 3 270M's 256 against 160, rope bases 1e6 and 1e4)."""
    if family == "qwen3":
        return ModelShape("tiny-qwen3", vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=2048,
                          rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, family="qwen3")
    if family == "gemma3":
        return ModelShape("tiny-gemma3", vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_layers=7,
                          num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=2048,
                          rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, family="gemma3",
                          sliding_window=8, sliding_window_pattern=6, rope_local_theta=10000.0,
                          query_pre_attn_scalar=64.0)
    raise ValueError(f"no tiny shape for family {family!r}; known: {', '.join(f for f in FAMILIES if f != 'llama')}")
