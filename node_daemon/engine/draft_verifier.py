"""Verifying one request's n-gram draft against the model's logits at each of its rows, so that its outputs are those
it would have sampled one token at a time.

Rows 0..k of a verification hold the distributions after the newest token and after each draft token. The
distribution of a row is the sampler's (sampler.py): logit_bias, temperature, then min_p / top-k / top-p (penalties
and seeded random rows never get here: speculation.can_draft).

- Greedy: the draft's tokens are kept while each equals its row's argmax; then the argmax of the first row that
  disagreed (or of the last row, all kept).
- Random: an n-gram draft is a point mass on its token x, so speculative sampling's rule reduces to: keep x with
  probability p(x); on the first rejection sample from p with x removed, renormalised; all kept, sample the last row
  from p. Each output token is then distributed exactly as p given the tokens before it.

Logprobs of every output token come from the same rows as the sampler's (before truncation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stallfree.node_daemon.engine.sampler import (Sampler, TokenLogprobs, _logprobs, _restricts, _RowSource,
                                                  argmax_rows, restricted_support)
from stallfree.node_daemon.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class Verified:
    num_accepted: int  # leading draft tokens kept
    token: int  # the token sampled after them
    logprobs: list[TokenLogprobs] | None  # one per output token (the kept drafts, then `token`), when asked


@torch.inference_mode()
def verify_draft(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, request_id: str,
                 draft: list[int]) -> Verified:
    """logits [1 + len(draft), vocab]: the verification's rows, in order."""
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{logits.shape[0]} logit rows for a draft of {k} tokens")
    rows = _processed(sampler, logits, params, request_id)
    if params.greedy:
        best = argmax_rows(rows)
        accepted = 0
        while accepted < k and best[accepted] == draft[accepted]:
            accepted += 1
        token = best[accepted]
    else:
        accepted, token = _rejection_sample(rows / params.temperature, params, draft)
    logprobs = None
    if params.logprobs is not None:
        tokens = [*draft[:accepted], token]
        wanted = list(range(accepted + 1))
        logprobs = _logprobs(_RowSource(rows, None, []), [params] * (k + 1), wanted, tokens + [0] * (k - accepted))
        logprobs = logprobs[:accepted + 1]
    return Verified(accepted, token, logprobs)


def _processed(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, request_id: str) -> torch.Tensor:
    """float32 rows after logit_bias (the only processing a draftable request may ask for)."""
    if not params.processes_logits:
        return logits.float()
    every = list(range(logits.shape[0]))
    return sampler._process(logits, [params] * len(every), [request_id] * len(every), None, every)


def _rejection_sample(scaled: torch.Tensor, params: SamplingParams, draft: list[int]) -> tuple[int, int]:
    """(tokens kept, the token after them) for temperature-scaled rows, by the point-mass rule above."""
    k = len(draft)
    num_rows, vocab = scaled.shape
    if _restricts(params, vocab):
        ids, weights = restricted_support(scaled, [params] * num_rows)
    else:
        ids, weights = None, (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()
    if k:
        draft_t = torch.tensor(draft, dtype=torch.long, device=scaled.device).unsqueeze(1)
        if ids is None:
            at = draft_t
            mass = weights[:k].gather(1, at).squeeze(1)
        else:
            hit = ids[:k] == draft_t  # where each draft token sits among its row's candidates (if it does)
            at = hit.long().argmax(dim=1, keepdim=True)
            mass = torch.where(hit.any(dim=1), weights[:k].gather(1, at).squeeze(1), weights.new_zeros(k))
        p_draft = (mass / weights[:k].sum(dim=-1)).tolist()
        u = torch.rand(k, device=scaled.device).tolist()
        for i in range(k):
            if not u[i] < p_draft[i]:
                row = weights[i].clone()
                row[at[i, 0]] = 0.0 if p_draft[i] > 0 else row[at[i, 0]]  # x removed (nothing to remove at p(x)=0)
                return i, _race(row, None if ids is None else ids[i])
    return k, _race(weights[k], None if ids is None else ids[k])


def _race(weights: torch.Tensor, ids: torch.Tensor | None) -> int:
    """A draw from unnormalised weights: argmax of w / q, q ~ Exp(1) (the sampler's exponential race)."""
    q = torch.empty_like(weights).exponential_()
    j = int((weights / q).argmax())
    return j if ids is None else int(ids[j])
