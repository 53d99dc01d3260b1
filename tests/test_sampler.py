"""Sampler: greedy is argmax, top-k/top-p restrict the support, seeds reproduce, rows stay independent."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.node_daemon.engine.request import Request
from stallfree.node_daemon.engine.sampler import Sampler, restricted_support
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


# ---- against straightforward references (full sort, dense penalties) -------------------------------------


def _reference_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's sampling distribution the obvious way: min_p, then top-k, then top-p on a full sort."""
    probs = torch.softmax(x.double() / p.temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    kept_probs = probs.clone()
    if p.min_p > 0:
        kept_probs[probs < p.min_p * probs.max()] = 0
    if 0 < p.top_k < len(probs):
        kept_probs[order[p.top_k:]] = 0
    kept_probs = kept_probs / kept_probs.sum()
    for rank, token in enumerate(order.tolist()):
        if kept_probs[token] == 0 and rank > 0:
            continue
        if p.top_p < 1.0 and mass >= p.top_p and rank > 0:
            break
        keep[token] = True
        mass += float(kept_probs[token])
    out = torch.where(keep, kept_probs, torch.zeros_like(kept_probs))
    return out / out.sum()


def _support_probs(x: torch.Tensor, params: list[SamplingParams], candidates: int) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    ids, weights = restricted_support(x / temps, params, candidates=candidates)
    dense = torch.zeros(x.shape, dtype=torch.float64).scatter_(1, ids, weights.double())
    return dense / dense.sum(dim=-1, keepdim=True)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0, 1, 5, 40]), st.sampled_from([1.0, 0.95, 0.5, 0.1]),
       st.sampled_from([0.0, 0.05, 0.3]), st.sampled_from([0.05, 0.7, 1.3]), st.sampled_from([0.3, 3.0]),
       st.sampled_from([4, 16, 1000]))
def test_restricted_support_equals_a_full_sort_reference(seed, top_k, top_p, min_p, temperature, scale,
                                                         candidates) -> None:
    # Flat rows (scale 0.3) need more than a few candidates: the full-sort fallback must take over exactly.
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(seed)) * scale
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if not (0 < top_k < 300 or top_p < 1 or min_p > 0):
        return
    mixed = [p, SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.8, top_k=3)]
    # With and without a row that has no top-k (every row bounded by its top-k needs no extra candidates).
    for group in (mixed, [p, mixed[2]]):
        _check_support(x, group, candidates)


def _check_support(x: torch.Tensor, group: list[SamplingParams], candidates: int) -> None:
    got = _support_probs(x[:len(group)], group, candidates)
    for row, params in enumerate(group):
        want = _reference_probs(x[row], params)
        # Same support, up to tokens whose probability underflows float32 (never drawn either way).
        assert not bool(((got[row] > 0) & (want == 0)).any()), (row, params)
        assert not bool(((want > 1e-30) & (got[row] == 0)).any()), (row, params)
        assert torch.allclose(got[row], want, atol=1e-5)


def test_a_temperature_that_underflows_is_greedy() -> None:
    logits = _logits(4, vocab=1000) * 30
    params = [SamplingParams(temperature=t, top_p=0.9) for t in (1e-7, 1e-30, 5e-6, 0.0)]
    assert all(p.greedy for p in params)
    assert Sampler().sample(logits, params, list("abcd")) == logits.argmax(-1).tolist()


def test_seeded_row_does_not_depend_on_the_candidate_count() -> None:
    # A wide top_k elsewhere in the batch widens the candidate set; the seeded row's draws must not move.
    vocab = 2000
    seeded = SamplingParams(temperature=1.0, top_p=0.8, seed=7)
    a, b = Sampler(), Sampler()
    for step in range(10):
        x = torch.randn(2, vocab, generator=torch.Generator().manual_seed(step)) * 3
        alone = a.sample(x[:1], [seeded], ["r"])[0]
        beside = b.sample(x, [seeded, SamplingParams(temperature=1.0, top_k=1500)], ["r", "w"])[0]
        assert alone == beside


def _history(prompt: list[int], output: list[int]) -> Request:
    """The token history the engine hands the sampler: a request's prompt, then its outputs."""
    request = Request("h", prompt, SamplingParams())
    for token in output:
        request.append_output_token(token)
    return request


def _reference_penalties(x: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    x = x.clone().double()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(output):
        x[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return x


def test_penalties_and_bias_equal_a_straightforward_reference() -> None:
    vocab = 64
    gen = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, frequency_penalty=0.7, presence_penalty=-0.4),
              SamplingParams(temperature=0.0),  # untouched beside penalised rows
              SamplingParams(temperature=0.5, repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0,
                             logit_bias={3: 5.0, 9: -100.0})]
    histories = [_history([1, 2, 2, 5], []) for _ in params]
    sampler = Sampler()
    for step in range(12):  # the counts are kept incrementally: check them as the outputs grow
        x = torch.randn(4, vocab, generator=gen) * 3
        got = sampler.processed_logits(x, params, list("abcd"), histories)
        for row, p in enumerate(params):
            want = _reference_penalties(x[row], p, histories[row].prompt_token_ids, histories[row].output_token_ids)
            assert torch.allclose(got[row].double(), want, atol=1e-5), (step, row)
        tokens = sampler.sample(x, params, list("abcd"), histories)
        for row, token in enumerate(tokens):
            histories[row].append_output_token(token if step % 3 else 7)  # repeats, so counts exceed 1


def test_greedy_with_penalties_is_the_argmax_of_the_penalised_logits() -> None:
    x = torch.tensor([[5.0, 4.9, 0.0, -1.0]])
    p = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert Sampler().sample(x, [SamplingParams(temperature=0.0)], ["a"]) == [0]
    assert Sampler().sample(x, [p], ["a"], [_history([], [0])]) == [1]


def test_logit_bias_forces_and_bans_tokens() -> None:
    x = _logits(2, vocab=100)
    force = SamplingParams(temperature=1.0, logit_bias={42: 100.0})
    ban = SamplingParams(temperature=0.0, logit_bias={int(x[1].argmax()): -100.0})
    out = Sampler().sample(x, [force, ban], ["a", "b"])
    assert out[0] == 42 and out[1] == int(x[1].topk(2).indices[1])


def test_min_p_keeps_only_tokens_near_the_best() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    sampler = Sampler()
    params = [SamplingParams(temperature=1.0, min_p=0.5)] * 500
    out = sampler.sample(x.expand(500, 4), params, [str(i) for i in range(500)])
    assert set(out) == {0, 1}  # 0.12 < 0.5 * 0.5


def test_logprobs_are_the_log_softmax_the_sampler_used() -> None:
    x = _logits(3, vocab=500)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.7, logprobs=2, seed=1),
              SamplingParams(temperature=0.0)]
    out = Sampler().sample_rows(x, params, list("abc"))
    assert out.logprobs[2] is None
    for row, temperature in ((0, 1.0), (1, 0.7)):  # greedy rows are reported at temperature 1
        want = torch.log_softmax(x[row] / temperature, dim=-1)
        lp = out.logprobs[row]
        assert lp.token_id == out.token_ids[row]
        assert abs(lp.logprob - float(want[lp.token_id])) < 1e-5
        top_vals, top_ids = want.topk(params[row].logprobs)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_vals, atol=1e-5)
    assert out.logprobs[0].top[0][0] == out.token_ids[0]  # greedy picks the most likely


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    out = Sampler().sample_rows(_logits(1), [SamplingParams(temperature=0.0, logprobs=0)], ["a"])
    assert out.logprobs[0].top == [] and out.logprobs[0].logprob <= 0
