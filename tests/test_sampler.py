"""Sampler: greedy is argmax, top-k/top-p restrict the support, seeds reproduce, rows stay independent."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.node_daemon.engine.sampler import Sampler
from stallfree.node_daemon.engine.sampling_params import SamplingParams


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_are_argmax_even_beside_random_rows() -> None:
    logits = _logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=5)]
    out = Sampler().sample(logits, params, ["a", "b", "c", "d"])
    argmax = logits.argmax(-1).tolist()
    assert out[0] == argmax[0] and out[2] == argmax[2]
    assert Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 4, list("abcd")) == argmax


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 10), st.floats(0.3, 2.0), st.integers(0, 10_000))
def test_top_k_never_leaves_the_k_best(k: int, temperature: float, seed: int) -> None:
    logits = _logits(3, seed=seed)
    params = [SamplingParams(temperature=temperature, top_k=k)] * 3
    allowed = logits.topk(k, dim=-1).indices
    for _ in range(5):
        out = Sampler().sample(logits, params, ["a", "b", "c"])
        assert all(tok in allowed[i].tolist() for i, tok in enumerate(out))


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 0.95), st.integers(0, 10_000))
def test_top_p_stays_inside_the_nucleus(top_p: float, seed: int) -> None:
    logits = _logits(2, seed=seed)
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    # The nucleus: the smallest prefix of the sorted tokens whose mass reaches top_p.
    nucleus = [set(order[i, : int((sorted_probs[i].cumsum(0) < top_p).sum()) + 1].tolist()) for i in range(2)]
    sampler = Sampler()
    for _ in range(10):
        out = sampler.sample(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 2, ["a", "b"])
        assert out[0] in nucleus[0] and out[1] in nucleus[1]


def test_top_p_tiny_keeps_only_the_best_token() -> None:
    logits = _logits(3)
    out = Sampler().sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 3, list("abc"))
    assert out == logits.argmax(-1).tolist()


def test_seeded_requests_reproduce_whatever_shares_the_batch() -> None:
    vocab = 200
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.9)
    alone, crowded = Sampler(), Sampler()
    solo_tokens, crowd_tokens = [], []
    for step in range(20):
        logits = _logits(1, vocab, seed=step)
        solo_tokens += alone.sample(logits, [seeded], ["r"])
        others = _logits(3, vocab, seed=100 + step)
        batch = torch.cat([others[:1], logits, others[1:]])
        params = [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.7, top_k=3),
                  SamplingParams(temperature=1.0, seed=99)]
        crowd_tokens.append(crowded.sample(batch, params, ["x", "r", "y", "z"])[1])
    assert solo_tokens == crowd_tokens
    assert len(set(solo_tokens)) > 1  # it really samples
    # A different seed gives a different sequence; freeing the request restarts its stream.
    other = Sampler()
    other_tokens = [other.sample(_logits(1, vocab, seed=s), [SamplingParams(temperature=1.0, seed=4321, top_p=0.9)], ["r"])[0]
                    for s in range(20)]
    assert other_tokens != solo_tokens
    alone.free("r")
    assert alone.sample(_logits(1, vocab, seed=0), [seeded], ["r"])[0] == solo_tokens[0]


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler()
    counts = torch.zeros(3)
    params = [SamplingParams(temperature=1.0)] * 2000
    out = sampler.sample(logits.expand(2000, 3), params, [str(i) for i in range(2000)])
    counts += torch.bincount(torch.tensor(out), minlength=3)
    freq = counts / counts.sum()
    assert abs(freq[0] - 0.7) < 0.05 and abs(freq[1] - 0.2) < 0.05 and abs(freq[2] - 0.1) < 0.04


def test_row_count_mismatch_is_an_error() -> None:
    import pytest

    with pytest.raises(ValueError, match="logit rows"):
        Sampler().sample(_logits(2), [SamplingParams()], ["a"])
