"""The grammar library's view of the served vocabulary: every token's bytes, handed over as a list.

llguidance can build its view from the tokenizer's JSON, but then it parses the JSON into a tokenizer of its own:
on Gemma 3's 262k pieces that took 2-3.4 s of a start, held the GIL throughout, and kept 0.2 GB resident for
the daemon's life. The tokenizer already here knows each token's bytes, so the library gets just those (and
tokenizes through this one when it must): 0.9 s, and 110 MB resident for Gemma 3 (the library's own tables of
262k tokens; 16 MB of it this list). The bytes follow the two decoders this project
builds (GPT-2's byte-level alphabet; SentencePiece's "▁" with <0xNN> byte pieces, text/sentencepiece_bpe.py); any
other decoder (a Hugging Face folder's own) takes the library's JSON path as before.
"""
from __future__ import annotations

import json

import llguidance
from tokenizers import decoders

from stallfree.node_daemon.text.sentencepiece_bpe import BYTE_PIECE, SentencePieceBPE
from stallfree.node_daemon.text.tokenizer import Tokenizer, bytes_to_unicode


def grammar_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's LLTokenizer for `tokenizer`, padded to `vocab_size` ids (padding ids: empty, never allowed)."""
    eos = list(tokenizer.eos_token_ids)
    table = token_bytes(tokenizer)
    if table is None:
        return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    tokens, special = table
    tokens = tokens + [b""] * (vocab_size - len(tokens))  # the wrapper's vocabulary is its list, not n_vocab
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, tokens, special, eos[0])),
                                  n_vocab=vocab_size, eos_token=eos)


def token_bytes(tokenizer: Tokenizer) -> tuple[list[bytes], list[int]] | None:
    """(each id's bytes, the special ids), or None when the decoder is not one of the two known here."""
    backend = tokenizer.backend
    if isinstance(backend, SentencePieceBPE):
        return _sentencepiece_bytes(backend)
    kind = _decoder_kind(backend.decoder)
    if kind is None:
        return None
    added = backend.get_added_tokens_decoder()
    n = backend.get_vocab_size(with_added_tokens=True)
    tokens: list[bytes] = []
    if kind == "byte-level":
        to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        for i in range(n):
            piece = backend.id_to_token(i) or ""
            if i in added:  # added tokens are stored as their text, not in the byte alphabet
                tokens.append(piece.encode())
            else:
                tokens.append(bytes(to_byte[c] for c in piece) if all(c in to_byte for c in piece) else piece.encode())
    else:
        tokens = [_sentencepiece_piece(backend.id_to_token(i) or "", i in added) for i in range(n)]
    return _without_marks(tokens), sorted(i for i, token in added.items() if token.special)


def _sentencepiece_bytes(backend: SentencePieceBPE) -> tuple[list[bytes], list[int]]:
    tokens = [_sentencepiece_piece(piece, i in backend.added) for i, piece in enumerate(backend.tokens)]
    return _without_marks(tokens), sorted(i for i, added in backend.added.items() if added.special)


def _sentencepiece_piece(piece: str, added: bool) -> bytes:
    """A SentencePiece piece's bytes: <0xNN> is the byte NN, "▁" a space; an added token is its text."""
    byte = None if added else BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()


def _without_marks(tokens: list[bytes]) -> list[bytes]:
    # The library keeps byte 0xFF as its mark of a special token: a piece that starts with it is empty there.
    return [b"" if t.startswith(b"\xff") else t for t in tokens]


def _decoder_kind(decoder) -> str | None:
    if decoder is None:
        return None
    if isinstance(decoder, decoders.ByteLevel):
        return "byte-level"
    state = json.loads(decoder.__getstate__())
    steps = [d.get("type") for d in state.get("decoders", [])] if state.get("type") == "Sequence" else []
    if steps[:3] == ["Replace", "ByteFallback", "Fuse"] and state["decoders"][0].get("content") == " ":
        return "sentencepiece"
    return None


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: the bytes, the special ids, and a way to tokenize text."""

    bos_token_id = None

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], special: list[int], eos: int) -> None:
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes with bytes: str only, so it hands over text
            raise TypeError("text only")
        return self._tokenizer.encode(text, add_special_tokens=False)
