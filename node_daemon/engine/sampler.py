"""Token sampling over one iteration's sampling rows: greedy, temperature, top-k, top-p, per-request seeds.

Batched: one sort over the rows that need top-k/top-p, one softmax, then the exponential-race trick
(argmax of p / q with q ~ Exp(1) draws from p) so every row samples in one vectorised step. Seeded
requests draw their q from their own torch.Generator, so their tokens are reproducible whatever else is
in the batch. Greedy rows never touch randomness; an all-greedy batch is a single argmax.
"""
from __future__ import annotations

from typing import Sequence

import torch

from stallfree.node_daemon.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}

    def free(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], request_ids: Sequence[str]) -> list[int]:
        """logits [num_rows, vocab] -> one token id per row (row i belongs to request_ids[i])."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} sampling params")
        if not params:
            return []
        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        tokens = self._sample_random(logits, params, greedy, request_ids)
        if any(greedy):
            argmax = logits.argmax(dim=-1)
            mask = torch.tensor(greedy, device=logits.device)
            tokens = torch.where(mask, argmax, tokens)
        return tokens.tolist()

    def _sample_random(self, logits: torch.Tensor, params: Sequence[SamplingParams], greedy: list[bool],
                       request_ids: Sequence[str]) -> torch.Tensor:
        num_rows, vocab = logits.shape
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                             dtype=torch.float32, device=logits.device)
        scaled = logits.float() / temps.unsqueeze(1)
        restrict = any((0 < p.top_k < vocab) or p.top_p < 1.0 for p in params)
        if restrict:
            scaled, order = scaled.sort(dim=-1, descending=True)
            scaled = _mask_top_k_top_p(scaled, params, vocab)
        probs = scaled.softmax(dim=-1)
        q = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
        if len(seeded) < num_rows:
            q.exponential_()
        for i in seeded:
            q[i].exponential_(generator=self._generator(request_ids[i], params[i].seed))
        picked = (probs / q).argmax(dim=-1)
        if restrict:
            picked = order.gather(1, picked.unsqueeze(1)).squeeze(1)
        return picked


def _mask_top_k_top_p(sorted_logits: torch.Tensor, params: Sequence[SamplingParams], vocab: int) -> torch.Tensor:
    """Set to -inf every sorted position outside a row's top-k and its top-p nucleus (the best always stays)."""
    device = sorted_logits.device
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    outside = ranks >= top_k.unsqueeze(1)
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(dim=-1)
        # Mass strictly before each position: a position is kept while that mass is below top_p.
        before = probs.cumsum(dim=-1) - probs
        outside |= before >= torch.tensor(top_p, device=device).unsqueeze(1)
    outside[:, 0] = False
    return sorted_logits.masked_fill(outside, float("-inf"))
