"""n-gram speculation on the real embedded SmolLM2: greedy outputs (tokens, text, logprobs, stop strings) identical
with speculation on and off, drafts verified and accepted where the answer repeats its prompt."""
from __future__ import annotations

import json

from model_helpers import ENGLISH_PASSAGE, smollm2_runner, smollm2_tokenizer

from stallfree.contracts import Ceilings, Tuning
from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stallfree.node_daemon.engine.engine import LLMEngine
from stallfree.node_daemon.engine.model_executor import ModelExecutor
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.speculation import SpeculativeConfig
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.structured.compiler import GrammarCompiler
from stallfree.node_daemon.structured.grammar import compile_response_format

CODE = "def area(width, height):\n    return width * height\n\n"
PROMPTS = [
    f"Copy the passage word for word.\nPassage: {ENGLISH_PASSAGE}\nCopy: {ENGLISH_PASSAGE[:40]}",
    f"{CODE}# the same function, renamed to surface:\ndef surface(width, height):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "The capital of France is",
    f"Q: What does this say? {ENGLISH_PASSAGE}\nA: It says that",
    "red green blue red green blue red green",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def engine(speculative: bool) -> LLMEngine:
    runner = smollm2_runner()
    config = EngineConfig(
        model=ModelConfig(model="smollm2-135m"),
        cache=CacheConfig(block_size=16, num_blocks=runner.num_blocks),
        scheduler=SchedulerConfig(ceilings=Ceilings(max_token_budget=512, max_num_seqs=8),
                                  tuning=Tuning(token_budget=256, max_num_seqs=8),
                                  # Drafts for every request of the batch, past the CPU's cheap rows.
                                  speculative=SpeculativeConfig(method="ngram" if speculative else "off",
                                                                max_rows=256)),
    )
    return LLMEngine(config, executor=ModelExecutor(runner))


def run(speculative: bool, requests: list[tuple[str, SamplingParams]], grammars: dict[int, object] | None = None
        ) -> dict[str, list]:
    e = engine(speculative)
    for i, (prompt, sampling) in enumerate(requests):
        e.add_request(f"r{i}", prompt=prompt, sampling=sampling, grammar=(grammars or {}).get(i))
    outs: dict[str, list] = {}
    for _ in range(500):
        if not e.has_unfinished():
            return outs
        for out in e.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def test_greedy_outputs_are_identical_with_speculation_on_and_off():
    requests = [(p, GREEDY) for p in PROMPTS]
    requests += [
        (PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)),
        (PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0, stop=["height\n"])),
        (PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0, logit_bias={28: 2.0})),
        (PROMPTS[4], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),
    ]
    off, on = run(False, requests), run(True, requests)
    assert off.keys() == on.keys()
    for rid in off:
        a, b = off[rid], on[rid]
        assert [t for o in a for t in o.new_token_ids] == [t for o in b for t in o.new_token_ids], rid
        assert "".join(o.text for o in a) == "".join(o.text for o in b), rid
        assert (a[-1].finish_reason, a[-1].num_output_tokens) == (b[-1].finish_reason, b[-1].num_output_tokens), rid
        lp_a = [lp for o in a for lp in (o.logprobs or [])]
        lp_b = [lp for o in b for lp in (o.logprobs or [])]
        assert [lp.token_id for lp in lp_a] == [lp.token_id for lp in lp_b], rid
        assert all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(lp_a, lp_b)), rid
        assert all(o.num_drafted_tokens == 0 for o in a)
    accepted = sum(outs[-1].num_accepted_tokens for outs in on.values())
    drafted = sum(outs[-1].num_drafted_tokens for outs in on.values())
    assert drafted > 0 and accepted > 0
    # Fewer tokens per update than tokens overall: verifications delivered several tokens in one iteration.
    assert sum(len(outs) for outs in on.values()) < sum(len(outs) for outs in off.values())


def test_sampled_requests_are_served_with_drafts():
    sampling = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, ignore_eos=True, logprobs=1)
    on = run(True, [(PROMPTS[0], sampling), (PROMPTS[4], sampling)])
    for outs in on.values():
        tokens = [t for o in outs for t in o.new_token_ids]
        assert len(tokens) == outs[-1].num_output_tokens == 24 and outs[-1].finish_reason == "length"
        assert len([lp for o in outs for lp in o.logprobs]) == 24
    assert sum(outs[-1].num_drafted_tokens for outs in on.values()) > 0


def test_a_constrained_request_beside_verifications_follows_its_grammar():
    """An iteration with drafts and a constrained row (never drafted itself): the row is sampled under its mask and
    its token accepted by its grammar, as in an iteration without drafts."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    grammar = GrammarCompiler(smollm2_tokenizer()).compile(compile_response_format(
        {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}))
    requests = [(PROMPTS[2], GREEDY), (PROMPTS[5], GREEDY), (PROMPTS[0], GREEDY),
                ("The largest city of Japan, as JSON:", SamplingParams(max_tokens=40, temperature=0.0))]
    off, on = run(False, requests, {3: grammar}), run(True, requests, {3: grammar})
    assert sum(outs[-1].num_drafted_tokens for outs in on.values()) > 0
    texts = {name: "".join(o.text for o in outs["r3"]) for name, outs in (("off", off), ("on", on))}
    assert texts["on"] == texts["off"]
    document = json.loads(texts["on"])
    assert set(document) == {"city", "rank"} and 1 <= document["rank"] <= 9
