"""Greedy sampling's argmax in the compiled library (models/cpu_argmax.h) gives torch's answer: the first index of the
largest logit, the first NaN where a row has one, the first index of a row of -inf; rows shorter than a vector, with
a tail, and long enough to be split across threads; one row and many. Each tier's kernel (AVX-512; AVX2, forced on a
bigger CPU) where the CPU has it; without a C++ compiler these tests skip. And the sampler takes it once loaded."""
from __future__ import annotations

import pytest
import torch

from stallfree.node_daemon.engine import sampler as sampler_module
from stallfree.node_daemon.engine.sampler import Sampler
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.models import cpu_decode
from tier_kernels import KERNEL_TIERS, tier_kernels


@pytest.fixture(scope="module", params=KERNEL_TIERS)
def ops(request):
    return tier_kernels(request.param)


def _rows(rows: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    cases = {"random": x, "small integers (many ties)": (4 * x).round().clamp(-3, 3)}
    if vocab > 2:
        tied = x.clone()
        top = tied.max() + 1
        tied[:, vocab // 3] = top  # the same largest value twice: the first wins
        tied[:, 2 * vocab // 3] = top
        cases["tied top"] = tied
        nan = x.clone()
        nan[:, vocab - 1] = float("nan")
        nan[:, vocab // 2] = float("nan")  # the first NaN wins, wherever the largest value is
        cases["two NaNs"] = nan
    cases["all -inf"] = torch.full((rows, vocab), float("-inf"))
    late = torch.full((rows, vocab), float("-inf"))
    late[:, -1] = 0.0  # only the tail's last logit is finite
    cases["only the last"] = late
    return cases


@pytest.mark.parametrize("vocab", [1, 7, 31, 32, 33, 49152, 262144, 262147])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_argmax_rows_gives_torchs_answer(ops, rows, vocab):
    for name, logits in _rows(rows, vocab, seed=vocab + rows).items():
        assert ops.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist(), name


def test_argmax_rows_refuses_what_it_cannot_scan(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.zeros(8))


def test_greedy_sampling_takes_the_librarys_argmax_once_it_has_loaded(monkeypatch):
    if not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled extension unavailable: {cpu_decode.why_not()}")
    scanned = []
    real = cpu_decode.ops

    class Watched:
        def __getattr__(self, name):
            op = getattr(real(), name)
            return (lambda logits: scanned.append(logits.shape) or op(logits)) if name == "argmax_rows" else op

    monkeypatch.setattr(cpu_decode, "ops", lambda tier=None: Watched())
    logits = torch.randn(2, 300)
    logits[1, 7] = logits[1, 9] = logits.max() + 1
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    assert Sampler().sample(logits, params, ["a", "b"]) == logits.argmax(-1).tolist()
    assert scanned == [(2, 300)]
    assert sampler_module.argmax_rows(logits.double()) == logits.argmax(-1).tolist()  # not float32: torch's
    assert scanned == [(2, 300)]
