"""Constrained decoding over SmolLM2's real tokenizer: schemas produce valid JSON, dead ends end clearly,
masks touch only the constrained rows, compiles are cached and run off the event loop."""
from __future__ import annotations

import asyncio
import json
from typing import Literal, Optional

import jsonschema
import pytest
import torch
from pydantic import BaseModel, Field
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from stallfree.node_daemon.structured.compiler import GrammarCompiler
from stallfree.node_daemon.structured.grammar import compile_response_format, json_schema_grammar
from stallfree.node_daemon.structured.masks import MaskFiller, StepMasks, apply_masks, fill_masks
from stallfree.node_daemon.structured.matcher import FINISH_GRAMMAR_DEAD_END
from stallfree.node_daemon.text.tokenizer import Tokenizer, bytes_to_unicode
from tests.structured_helpers import FakeModel, masked_greedy, smollm2_tokenizer


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: Literal["FR", "DE", "JP"]


class Item(BaseModel):
    sku: str = Field(max_length=12)
    quantity: int = Field(ge=1, le=99)


class Order(BaseModel):
    order_id: int = Field(ge=0, le=10**6)
    shipping: Address
    items: list[Item] = Field(min_length=1, max_length=3)
    status: Literal["pending", "paid", "shipped"]
    note: Optional[str] = Field(default=None, max_length=30)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


def _schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "order", "schema": schema, "strict": strict}}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_masked_greedy_decode_writes_a_document_the_schema_validates(tokenizer, compiler, seed):
    schema = Order.model_json_schema()
    compiled = compiler.compile(compile_response_format(_schema_format(schema)))
    [(tokens, finish)] = masked_greedy(compiled, FakeModel(tokenizer, seed), tokenizer.eos_token_ids)
    assert finish == "stop"
    document = json.loads(tokenizer.decode(tokens))
    jsonschema.validate(document, schema)
    Order.model_validate(document)


def test_sixteen_rows_decoded_together_each_validate(tokenizer, compiler):
    schema = Order.model_json_schema()
    compiled = compiler.compile(compile_response_format(_schema_format(schema, strict=False)))
    results = masked_greedy(compiled, FakeModel(tokenizer, 7), tokenizer.eos_token_ids, rows=16)
    assert [finish for _, finish in results] == ["stop"] * 16
    documents = [json.loads(tokenizer.decode(tokens)) for tokens, _ in results]
    for document in documents:
        jsonschema.validate(document, schema)
    assert len({json.dumps(d) for d in documents}) > 1  # rows are independent, not one row copied


def test_json_object_mode_writes_an_object(tokenizer, compiler):
    compiled = compiler.compile(compile_response_format({"type": "json_object"}))
    [(tokens, finish)] = masked_greedy(compiled, FakeModel(tokenizer, 3, closing_bonus=6.0), tokenizer.eos_token_ids)
    assert finish == "stop"
    assert isinstance(json.loads(tokenizer.decode(tokens)), dict)


def test_text_format_and_none_need_no_grammar():
    assert compile_response_format(None) is None
    assert compile_response_format({"type": "text"}) is None


@pytest.mark.parametrize("schema, named", [
    ({"type": "string", "not": {"const": "a"}}, "not"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"type": "string", "format": "hostname-ish"}, "hostname-ish"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "/$defs/missing"),
    ({"type": "strng"}, "strng"),
])
def test_a_construct_the_library_cannot_follow_is_a_value_error_naming_it(schema, named):
    with pytest.raises(ValueError) as error:
        compile_response_format(_schema_format(schema))
    assert named in str(error.value) and "json_schema:order" in str(error.value)


@pytest.mark.parametrize("schema, named", [
    ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    ({"allOf": [{"const": "a"}, {"const": "b"}]}, "Unsatisfiable"),
])
def test_an_unsatisfiable_schema_is_refused_before_any_decoding(schema, named):
    with pytest.raises(ValueError, match=named):
        compile_response_format(_schema_format(schema))


@pytest.mark.parametrize("response_format, says", [
    ({"type": "xml"}, "'xml' is not supported"),
    ({"type": "json_schema"}, "needs a `json_schema` object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs a `schema`"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be true or false"),
    ({"type": "json_schema", "json_schema": {"schema": [1, 2]}}, "must be a JSON object"),
    ("json", "must be an object"),
])
def test_malformed_response_formats_say_what_is_wrong(response_format, says):
    with pytest.raises(ValueError, match=says):
        compile_response_format(response_format)


def _tiny_tokenizer(pieces: str) -> Tokenizer:
    """A byte-level vocabulary of the given characters and an end-of-text token, nothing else."""
    to_char = bytes_to_unicode()
    vocab = {to_char[ord(c)]: i for i, c in enumerate(pieces)}
    vocab["<|endoftext|>"] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return Tokenizer(backend, eos_token_ids=(len(pieces),), bos_token_id=None, add_bos_token=False, chat_template=None)


def test_a_schema_the_vocabulary_cannot_finish_ends_with_the_dead_end_reason():
    # "ac" must be written, but the vocabulary has no "c": generation cannot go on past '"a'.
    tokenizer = _tiny_tokenizer('"a{}')
    compiled = GrammarCompiler(tokenizer).compile(json_schema_grammar({"const": "ac"}))
    [(tokens, finish)] = masked_greedy(compiled, FakeModel(tokenizer, 0), tokenizer.eos_token_ids, max_steps=50)
    assert finish == FINISH_GRAMMAR_DEAD_END
    assert tokenizer.decode(tokens) == '"a'


def test_a_schema_the_vocabulary_cannot_begin_is_refused_at_compile():
    tokenizer = _tiny_tokenizer('"a{}')  # no digit, no minus sign: no integer can start
    with pytest.raises(ValueError, match="no token of this model's vocabulary can begin"):
        GrammarCompiler(tokenizer).compile(json_schema_grammar({"type": "integer"}))


def test_a_refused_token_or_an_empty_mask_marks_the_matcher_dead(tokenizer, compiler):
    matcher = compiler.compile(json_schema_grammar({"type": "object"})).new_matcher()
    assert not matcher.accept(tokenizer.encode("x", add_special_tokens=False)[0])
    assert matcher.dead_end
    masks = fill_masks([matcher], compiler.vocab_size)
    assert masks.dead == [0] and torch.isinf(masks.bias[0]).all()


def test_masks_change_only_the_constrained_rows(tokenizer, compiler):
    compiled = compiler.compile(json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}))
    logits = torch.randn(4, tokenizer.vocab_size)
    before = logits.clone()
    masks = fill_masks([compiled.new_matcher(), compiled.new_matcher()], compiler.vocab_size)
    apply_masks(logits, [1, 3], masks)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    for row in (1, 3):
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert brace in allowed and len(allowed) < 10
        assert logits[row, brace] == before[row, brace]


def test_logits_wider_than_the_tokenizer_block_the_padding_ids(tokenizer):
    compiler = GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 40)
    compiled = compiler.compile(json_schema_grammar({"type": "object"}))
    masks = fill_masks([compiled.new_matcher()], compiler.vocab_size)
    logits = torch.zeros(1, tokenizer.vocab_size + 40)
    apply_masks(logits, [0], masks)
    assert torch.isinf(logits[0, tokenizer.vocab_size:]).all()
    with pytest.raises(ValueError, match="2 rows for 1 masks"):
        apply_masks(logits, [0, 0], masks)


def test_bfloat16_logits_are_masked_too(tokenizer, compiler):
    compiled = compiler.compile(json_schema_grammar({"type": "boolean"}))
    masks = fill_masks([compiled.new_matcher()], compiler.vocab_size)
    logits = torch.randn(2, tokenizer.vocab_size, dtype=torch.bfloat16)
    apply_masks(logits, [1], masks)
    allowed = {tokenizer.decode([t]) for t in torch.isfinite(logits[1]).nonzero().flatten().tolist()}
    assert allowed and all("true".startswith(a) or "false".startswith(a) for a in allowed)


def test_the_mask_filler_computes_the_next_step_on_its_worker(tokenizer, compiler):
    compiled = compiler.compile(json_schema_grammar({"type": "array", "items": {"type": "integer"}, "maxItems": 2}))
    # Twins for the direct computation: a matcher is never touched while the worker holds it (MaskFiller's rule).
    matchers = [compiled.new_matcher() for _ in range(3)]
    twins = [compiled.new_matcher() for _ in range(3)]
    filler = MaskFiller(compiler.vocab_size)
    try:
        for matcher in matchers + twins:
            assert matcher.accept(tokenizer.encode("[", add_special_tokens=False)[0])
        pending = filler.masks_for([(f"r{i}", matcher) for i, matcher in enumerate(matchers)])
        assert filler.masks_for([("r0", matchers[0])]) == pending[:1]  # asked again: the same computation
        direct = fill_masks(twins, compiler.vocab_size)
        results: list[StepMasks] = [future.result(timeout=30) for future in pending]
        assert torch.equal(torch.cat([r.bias for r in results]), direct.bias)
        assert all(r.dead == [] for r in results)
    finally:
        filler.close()


def test_rollback_undoes_accepted_tokens(tokenizer, compiler):
    matcher = compiler.compile(json_schema_grammar({"type": "object"})).new_matcher()
    for token in tokenizer.encode('{"a":1', add_special_tokens=False):
        assert matcher.accept(token)
    accepted = matcher.num_accepted
    matcher.rollback(accepted)
    assert matcher.num_accepted == 0
    assert matcher.accept(tokenizer.encode("{", add_special_tokens=False)[0])
    with pytest.raises(ValueError, match="cannot roll back 5"):
        matcher.rollback(5)


def test_compiles_are_cached_by_grammar_and_run_off_the_event_loop(compiler):
    grammar = compile_response_format(_schema_format({"type": "object", "properties": {"z": {"type": "number"}}}))
    before = compiler.compiles
    first = asyncio.run(compiler.compile_async(grammar))
    second = compiler.compile(compile_response_format(_schema_format({"type": "object", "properties": {"z": {"type": "number"}}})))
    assert first is second and compiler.compiles == before + 1
    assert first.new_matcher() is not first.new_matcher()


def test_the_cache_forgets_the_least_recent_grammar(tokenizer):
    compiler = GrammarCompiler(tokenizer, max_cached=2)
    grammars = [json_schema_grammar({"const": i}) for i in range(3)]
    for g in grammars:
        compiler.compile(g)
    compiler.compile(grammars[2])
    assert compiler.compiles == 3
    compiler.compile(grammars[0])  # evicted: compiled again
    assert compiler.compiles == 4


def test_each_row_gets_its_own_mask_whatever_the_row_order(tokenizer, compiler):
    boolean = compiler.compile(json_schema_grammar({"type": "boolean"})).new_matcher()
    integer = compiler.compile(json_schema_grammar({"type": "integer"})).new_matcher()
    masks = fill_masks([boolean, integer, boolean], compiler.vocab_size)
    logits = torch.zeros(6, tokenizer.vocab_size)
    apply_masks(logits, [4, 1, 2], masks)  # runs: [4], [1, 2]
    allowed = {row: {tokenizer.decode([t]) for t in torch.isfinite(logits[row]).nonzero().flatten().tolist()} for row in (1, 2, 4)}
    assert all(a and ("true".startswith(a) or "false".startswith(a)) for a in allowed[4] | allowed[2])
    assert "1" in allowed[1] and "t" not in allowed[1]
    assert all(torch.isfinite(logits[row]).all() for row in (0, 3, 5))
