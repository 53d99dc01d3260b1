"""Random weights of a named shape, reproducible from a seed (benchmarks and tests; like vLLM's dummy load).

Scales keep activations of order one through every layer (1/sqrt(fan_in) projections, unit
embeddings, unit norms), so logits are spread out and greedy choices are not near-ties: a random
model then exercises the same numerics as a trained one.
"""
from __future__ import annotations

import torch

from stallfree.node_daemon.models.llama import LlamaForCausalLM


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Draw every parameter in place on the model's own device (no host round trip for big shapes)."""
    device = model.device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.dim() == 1:  # qkv bias
            param.normal_(0.0, 0.1, generator=generator)
        elif name.startswith("embed_tokens"):
            param.normal_(0.0, 1.0, generator=generator)
        else:
            param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
