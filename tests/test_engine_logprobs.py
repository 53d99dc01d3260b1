"""Logprobs and penalties through the whole engine (tiny random-weight model) against the model's own logits.

The reference is a dense float64 forward of the prompt plus the generated tokens (test_llama_model's), whose
log-softmax at each position must equal what the engine reported for the token sampled there.
"""
from __future__ import annotations

import pytest
import torch

from stallfree.contracts import Ceilings, Tuning
from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.engine.engine import LLMEngine
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from test_llama_model import dense_llama_logits


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=256, dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(ceilings=Ceilings(max_token_budget=256, max_num_seqs=4),
                                  tuning=Tuning(token_budget=40, max_num_seqs=4)),  # chunked prompts
    )
    yield LLMEngine(config)
    torch.set_num_threads(threads)


def _run(engine: LLMEngine, requests: dict[str, SamplingParams], prompt: list[int]) -> dict[str, list]:
    outs: dict[str, list] = {rid: [] for rid in requests}
    for rid, sampling in requests.items():
        engine.add_request(rid, prompt_token_ids=prompt, sampling=sampling)
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def test_logprobs_equal_the_log_softmax_of_the_model_logits(engine: LLMEngine) -> None:
    prompt = list(range(5, 55))  # 50 tokens: prefilled in chunks at budget 40
    requests = {
        "greedy": SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True),
        "hot": SamplingParams(max_tokens=6, temperature=0.7, seed=11, logprobs=3, ignore_eos=True),
        "plain": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    }
    outs = _run(engine, requests, prompt)
    assert all(o.logprobs is None for o in outs["plain"])
    model = engine.executor.runner.model
    for rid, temperature in (("greedy", 1.0), ("hot", 0.7)):
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        entries = [lp for o in outs[rid] for lp in o.logprobs]
        assert [e.token_id for e in entries] == tokens
        logits = dense_llama_logits(model, prompt + tokens)
        for j, entry in enumerate(entries):
            want = torch.log_softmax(logits[len(prompt) - 1 + j] / temperature, dim=-1)
            assert abs(entry.logprob - float(want[entry.token_id])) < 2e-3, (rid, j)
            k = requests[rid].logprobs
            assert [t for t, _, _ in entry.top] == want.topk(k).indices.tolist()
            assert all(abs(lp - float(want[t])) < 2e-3 for t, _, lp in entry.top)
            assert entry.token == engine.tokenizer.decode([entry.token_id], skip_special_tokens=False)
        if rid == "greedy":
            assert all(e.top[0][0] == e.token_id for e in entries)


class _FailsBatched:
    """The real executor, except that an iteration of more than one chunk raises: the engine runs each alone."""

    def __init__(self, executor) -> None:
        self.executor = executor

    def execute(self, output):
        if len(output.chunks) > 1:
            raise RuntimeError("injected batch fault")
        return self.executor.execute(output)

    def __getattr__(self, name):
        return getattr(self.executor, name)


def test_logprobs_come_back_with_their_tokens_when_each_request_runs_alone(engine: LLMEngine) -> None:
    prompt = list(range(60, 70))
    requests = {"asks": SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True),
                "plain": SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)}
    batched = _run(engine, requests, prompt)
    engine.executor = _FailsBatched(engine.executor)
    try:
        alone = _run(engine, requests, prompt)
    finally:
        engine.executor = engine.executor.executor
    assert all(o.logprobs is None for o in alone["plain"])
    for rid in requests:
        assert [o.new_token_ids for o in alone[rid]] == [o.new_token_ids for o in batched[rid]]
    got = [(e.token_id, round(e.logprob, 3)) for o in alone["asks"] for e in o.logprobs]
    want = [(e.token_id, round(e.logprob, 3)) for o in batched["asks"] for e in o.logprobs]
    assert len(got) == 4 and got == want


def test_repetition_penalty_changes_greedy_output_like_the_reference(engine: LLMEngine) -> None:
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    base = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.8,
                               frequency_penalty=0.5)
    outs = _run(engine, {"base": base, "pen": penalised}, prompt)
    tokens = [t for o in outs["pen"] for t in o.new_token_ids]
    assert tokens != [t for o in outs["base"] for t in o.new_token_ids]  # the penalty does change the answer
    model = engine.executor.runner.model
    logits = dense_llama_logits(model, prompt + tokens)
    for j, token in enumerate(tokens):  # each greedy choice is the argmax of the reference-penalised logits
        x = logits[len(prompt) - 1 + j].clone()
        history = prompt + tokens[:j]
        for t in set(history):
            x[t] = x[t] / 1.8 if x[t] > 0 else x[t] * 1.8
        for t in set(tokens[:j]):
            x[t] -= 0.5 * tokens[:j].count(t)
        assert token == int(x.argmax()), j


@pytest.mark.slow
def test_smollm2_logprobs_equal_the_log_softmax_of_its_logits() -> None:
    """The real checkpoint: the engine's reported logprobs against a dense float64 forward of the same tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = EngineConfig(
            model=ModelConfig(model="smollm2-135m", max_model_len=512),
            cache=CacheConfig(block_size=16, num_blocks=32),
            scheduler=SchedulerConfig(ceilings=Ceilings(max_token_budget=256, max_num_seqs=4),
                                      tuning=Tuning(token_budget=64, max_num_seqs=4)),
        )
        engine = LLMEngine(config)
        prompt = engine.tokenizer.encode("The capital of France is")
        outs = _run(engine, {"r": SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)}, prompt)
        tokens = [t for o in outs["r"] for t in o.new_token_ids]
        entries = [lp for o in outs["r"] for lp in o.logprobs]
        assert "Paris" in entries[0].token
        logits = dense_llama_logits(engine.executor.runner.model, prompt + tokens)
        for j, entry in enumerate(entries):
            want = torch.log_softmax(logits[len(prompt) - 1 + j], dim=-1)
            assert abs(entry.logprob - float(want[entry.token_id])) < 1e-2, j
            assert [t for t, _, _ in entry.top] == want.topk(3).indices.tolist()
    finally:
        torch.set_num_threads(threads)
