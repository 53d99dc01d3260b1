"""The engine decoding under grammars: masks applied to the constrained rows only, each sequence its own matcher,
a complete document finishes the request, a dead end finishes it without a token, and the sim refuses grammars."""
from __future__ import annotations

import json
import time

import pytest
import torch

from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig
from stallfree.node_daemon.engine.engine import LLMEngine
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.structured.compiler import GrammarCompiler
from stallfree.node_daemon.structured.grammar import compile_response_format
from stallfree.node_daemon.structured.matcher import bitmask_words

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "b": {"type": "string", "maxLength": 4}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    torch.set_num_threads(1)
    return LLMEngine(EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=512)))


@pytest.fixture(scope="module")
def compiler(engine: LLMEngine) -> GrammarCompiler:
    return GrammarCompiler(engine.tokenizer, vocab_size=engine.executor.vocab_size)


def _run(engine: LLMEngine) -> dict[str, tuple[list[int], str, str]]:
    """request id -> (tokens, text, finish_reason), stepping until every request finished."""
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    done: dict[str, tuple[list[int], str, str]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.finished:
                done[out.request_id] = (tokens[out.request_id], texts[out.request_id], out.finish_reason)
    return done


def test_constrained_rows_follow_the_schema_and_free_rows_are_untouched(engine, compiler) -> None:
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request("alone", prompt_token_ids=[5, 6, 7], sampling=free)
    alone = _run(engine)["alone"][0]
    grammar = compiler.compile(compile_response_format(
        {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}))
    for i in range(3):  # greedy and sampled rows, each its own matcher, beside one free row
        engine.add_request(f"g{i}", prompt_token_ids=[1, 2, 3 + i],
                           sampling=SamplingParams(max_tokens=300, temperature=0.0 if i == 0 else 1.0, seed=i,
                                                   ignore_eos=True), grammar=grammar)
    engine.add_request("free", prompt_token_ids=[5, 6, 7], sampling=free)
    done = _run(engine)
    assert done["free"][0] == alone  # a constrained neighbour changes nothing of a free row
    for i in range(3):
        _, text, reason = done[f"g{i}"]
        assert reason == "stop", (text, reason)  # the complete document ends it, ignore_eos or not
        value = json.loads(text)
        assert set(value) == {"a", "b"} and 0 <= value["a"] <= 999 and len(value["b"]) <= 4


class _DeadAfter:
    """A matcher that allows every token for `steps` tokens, then none (a grammar with no way on)."""

    def __init__(self, vocab_size: int, steps: int) -> None:
        self.vocab_size, self.steps, self.num_accepted, self.dead_end = vocab_size, steps, 0, False
        self.last_mask_s = 0.0

    def fill_mask(self, row: torch.Tensor) -> bool:
        assert row.numel() == bitmask_words(self.vocab_size)
        row.fill_(-1 if self.num_accepted < self.steps else 0)
        self.dead_end = self.num_accepted >= self.steps
        return not self.dead_end

    def accept(self, token: int) -> bool:
        self.num_accepted += 1
        return True

    def is_terminated(self) -> bool:
        return False


class _RefusesSecond(_DeadAfter):
    """Allows everything but refuses the second token it is given."""

    def accept(self, token: int) -> bool:
        self.num_accepted += 1
        return self.num_accepted != 2


class _Grammar:
    def __init__(self, make) -> None:
        self.make = make

    def new_matcher(self):
        return self.make()


def test_a_dead_end_finishes_the_request_without_the_refused_token(engine) -> None:
    vocab = engine.executor.vocab_size
    sampling = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("dead", prompt_token_ids=[1, 2, 3], sampling=sampling,
                       grammar=_Grammar(lambda: _DeadAfter(vocab, 3)))
    engine.add_request("refused", prompt_token_ids=[1, 2, 4], sampling=sampling,
                       grammar=_Grammar(lambda: _RefusesSecond(vocab, 99)))
    engine.add_request("free", prompt_token_ids=[1, 2, 5], sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    done = _run(engine)
    assert done["dead"][2] == "grammar_dead_end" and len(done["dead"][0]) == 3
    assert done["refused"][2] == "grammar_dead_end" and len(done["refused"][0]) == 1
    assert done["free"][2] == "length" and len(done["free"][0]) == 6


class _SlowMasks:
    """A real matcher whose first `slow` masks take `seconds` each (a schema of thousands of properties)."""

    def __init__(self, inner, slow: int, seconds: float) -> None:
        self.inner, self.slow, self.seconds, self.masks = inner, slow, seconds, 0

    def fill_mask(self, row: torch.Tensor) -> bool:
        self.masks += 1
        if self.masks <= self.slow:
            time.sleep(self.seconds)
        return self.inner.fill_mask(row)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_slow_mask_never_holds_the_other_rows(engine, compiler) -> None:
    """The constrained row sits out the steps its mask is late for; every step still gives the free row its token,
    and the constrained row writes what it writes alone."""
    grammar = compiler.compile(compile_response_format(
        {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}))
    greedy = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    engine.add_request("alone", prompt_token_ids=[1, 2, 3], sampling=greedy, grammar=grammar)
    alone = _run(engine)["alone"]
    slow = _Grammar(lambda: _SlowMasks(grammar.new_matcher(), slow=3, seconds=0.3))
    engine.add_request("slow", prompt_token_ids=[1, 2, 3], sampling=greedy, grammar=slow)
    engine.add_request("free", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=40, ignore_eos=True))
    tokens: dict[str, list[int]] = {"slow": [], "free": []}
    done: dict[str, str] = {}
    steps_without_free_token = steps_without_slow_token = 0
    while engine.has_unfinished():
        outputs = {out.request_id: out for out in engine.step()}
        for rid, out in outputs.items():
            tokens[rid].extend(out.new_token_ids)
            if out.finished:
                done[rid] = out.finish_reason
        if "free" not in done and not outputs.get("free"):
            steps_without_free_token += 1
        if "slow" not in done and "free" not in done and "slow" not in outputs:
            steps_without_slow_token += 1
    assert steps_without_free_token == 0  # the free row never waited out a step for the slow mask
    assert steps_without_slow_token >= 1  # the slow row sat out steps while the free one went on
    assert tokens["slow"] == alone[0] and done["slow"] == "stop"
    assert len(tokens["free"]) == 40


def test_the_sim_backend_refuses_a_grammar_with_a_400() -> None:
    """The sim computes no logits: a request that needs a grammar is refused naming the field, others served."""
    import httpx

    from server_helpers import running_daemon

    with running_daemon(["--backend", "sim", "--no-profile"], base_args=["--model", "llama-3-8b", "--hardware",
                                                                          "h100", "--num-kv-blocks", "256"]) as live:
        body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
        refused = httpx.post(live.url + "/v1/chat/completions", timeout=30,
                             json=body | {"response_format": {"type": "json_object"}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
        assert "backend" in refused.json()["error"]["message"]
        assert httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_a_row_whose_masks_are_slow_gets_the_mask_worker_a_core(engine) -> None:
    """A mask slower than SLOW_MASK_S computed beside a two-thread forward stretched the whole step: while such a
    row runs the forward leaves the worker a core, and takes it back once the row is done."""
    from stallfree.node_daemon.engine.model_executor import SLOW_MASK_S

    class _SlowToMask(_DeadAfter):
        def fill_mask(self, row: torch.Tensor) -> bool:
            self.last_mask_s = 2 * SLOW_MASK_S
            return super().fill_mask(row)

    vocab = engine.executor.vocab_size
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine.add_request("slow", prompt_token_ids=[1, 2, 3], grammar=_Grammar(lambda: _SlowToMask(vocab, 99)),
                           sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engine.add_request("free", prompt_token_ids=[1, 2, 5], sampling=SamplingParams(max_tokens=12, ignore_eos=True))
        threads = []  # torch's threads after each step
        while engine.has_unfinished():
            engine.step()
            threads.append(torch.get_num_threads())
        assert threads[1] == 1  # the slow row's masks ran on a core of their own
        assert threads[-1] == 2  # the slow row gone: the forward has both cores again
    finally:
        torch.set_num_threads(before)
