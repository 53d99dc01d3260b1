"""The `tokenizers` library's tokenizer for a GGUF SentencePiece vocabulary, as Hugging Face's converter makes it:
the reference text/sentencepiece_bpe.py is held to. Merges are recovered from the pieces (every split of a normal
piece into two pieces of the vocabulary is a merge, ranked by the merged piece's score, then by the parts' ids),
byte fallback on, the control pieces added as special tokens and the user-defined ones as plain added tokens."""
from __future__ import annotations

from typing import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4


def library_tokenizer(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                      add_space_prefix: bool) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for i in sorted(range(len(tokens)), key=lambda i: -scores[i]):
        piece = tokens[i]
        if types[i] != _NORMAL:
            continue
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(splits, key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    unk = next((t for t, ty in zip(tokens, types) if ty == _UNKNOWN), None)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_space_prefix else []),
    ])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if user:
        backend.add_tokens(user)
    return backend
