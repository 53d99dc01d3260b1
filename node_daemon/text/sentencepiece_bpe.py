"""A GGUF file's SentencePiece BPE vocabulary (llama.cpp's "llama" tokenizer model) encoded from its pieces and scores.

The tokenizers library needs the merges this vocabulary implies, and a GGUF file carries none: every split of
every piece into two pieces is a merge, ranked by the merged piece's score (Hugging Face's converter). Recovering
them takes 0.7 s of Python on Gemma 3's 262k pieces (513k merges), and building the library's tokenizer from them,
or reading its JSON back, 0.4-0.85 s more with the GIL held: on a 2-core machine that was a quarter of a start.
This encoder needs no merges table: the rank of merging two adjacent symbols is computed from the merged piece's
score when it is met, and it gives the library's tokens exactly (tests/test_sentencepiece_bpe.py compares the two
on varied text, Gemma 3's file included):

- added tokens (the file's control and user-defined pieces) are matched first, in the raw text, leftmost and
  longest (the library's added vocabulary: not normalized, no stripping);
- every other span is normalized (" " -> "▁"; "▁" prepended where the file asks for a space prefix), split into
  characters (a character the vocabulary lacks becomes its UTF-8 bytes' <0xNN> pieces), and merged: always the
  adjacent pair of lowest rank, then the leftmost, where a pair's rank orders the merged piece by score
  (descending, then by id) and then the two parts' ids, as the library's merges list does.
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

SPACE = "\u2581"
_NORMAL = 1  # llama.cpp's token types: only normal pieces are ever the result of a merge
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4
_BYTE = 6
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class AddedPiece:
    """A piece matched in the raw text before the merges (control: special, skipped when decoding asks)."""

    content: str
    special: bool


class SentencePieceBPE:
    """Encode and decode with a GGUF file's SentencePiece pieces (tokenizer.ggml.tokens, .scores, .token_type)."""

    def __init__(self, tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                 add_space_prefix: bool) -> None:
        self.tokens = list(tokens)
        self.add_space_prefix = add_space_prefix
        self.vocab = dict(zip(self.tokens, range(len(self.tokens))))  # a repeated piece: its last id
        # A merged piece's place in the merges list: by score, highest first, then by id (a stable sort); -1 for a
        # piece that is never merged into (only normal pieces are). numpy: 262k pieces in 15 ms, not 0.1 s.
        kinds = np.asarray(types)
        order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
        rank = np.empty(len(self.tokens), dtype=np.int64)
        rank[order] = np.arange(len(self.tokens))
        rank[kinds != _NORMAL] = -1
        self._merge_rank: list[int] = rank.tolist()
        self.added = {i: AddedPiece(self.tokens[i], types[i] == _CONTROL)
                      for i in np.flatnonzero((kinds == _CONTROL) | (kinds == _USER_DEFINED)).tolist()}
        self._added_ids = {piece.content: i for i, piece in sorted(self.added.items())}
        self._added_trie = _trie(self._added_ids)
        self._added_starts = re.compile("[" + "".join(sorted({re.escape(p[0]) for p in self._added_ids if p})) + "]") \
            if self._added_ids else None
        self._byte_ids = {}
        for i in np.flatnonzero(kinds == _BYTE).tolist():
            match = BYTE_PIECE.fullmatch(self.tokens[i])
            if match:
                self._byte_ids[int(match.group(1), 16)] = i
        unknown = np.flatnonzero(kinds == _UNKNOWN)
        self._unknown = int(unknown[0]) if len(unknown) else None

    # -- encoding --------------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for span, added_id in self._split_added(text):
            if added_id is not None:
                ids.append(added_id)
            elif span:
                ids += self._merge(self._normalize(span))
        return ids

    def _split_added(self, text: str) -> Iterable[tuple[str, int | None]]:
        """The text as (span, None) and (added piece, its id), in order; added pieces leftmost-longest."""
        if self._added_starts is None:
            yield text, None
            return
        trie, start, pos = self._added_trie, 0, 0
        while True:
            hit = self._added_starts.search(text, pos)
            if hit is None:
                break
            pos = hit.start()
            node, end, found, j = trie, -1, None, pos
            while j < len(text) and (node := node.get(text[j])) is not None:
                j += 1
                if None in node:
                    end, found = j, node[None]
            if found is None:
                pos += 1
                continue
            if pos > start:
                yield text[start:pos], None
            yield text[pos:end], found
            start = pos = end
        if start < len(text):
            yield text[start:], None

    def _normalize(self, span: str) -> str:
        span = span.replace(" ", SPACE)
        return SPACE + span if self.add_space_prefix else span

    def _symbols(self, span: str) -> list[int]:
        """The span's characters as pieces; one the vocabulary lacks as its UTF-8 bytes' <0xNN> pieces, else (a
        byte piece missing too) the unknown piece, one for a run of them, else nothing (as the library does)."""
        vocab, byte_ids, symbols = self.vocab, self._byte_ids, []
        for char in span:
            i = vocab.get(char)
            if i is not None:
                symbols.append(i)
                continue
            pieces = [byte_ids.get(b) for b in char.encode()]
            if None not in pieces:
                symbols += pieces
            elif self._unknown is not None and not (symbols and symbols[-1] == self._unknown):
                symbols.append(self._unknown)
        return symbols

    def _rank(self, left: int, right: int) -> tuple[int, int, int, int] | None:
        merged = self.vocab.get(self.tokens[left] + self.tokens[right])
        if merged is None or self._merge_rank[merged] < 0:
            return None
        return self._merge_rank[merged], left, right, merged

    def _merge(self, span: str) -> list[int]:
        """The library's BPE word merge: a heap of (rank, position); stale entries are skipped when popped."""
        ids = self._symbols(span)
        n = len(ids)
        if n < 2:
            return ids
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = []
        for pos in range(n - 1):
            rank = self._rank(ids[pos], ids[pos + 1])
            if rank is not None:
                heap.append((rank[0], rank[1], rank[2], pos, rank[3]))
        heapq.heapify(heap)
        while heap:
            _, left_id, right_id, pos, merged = heapq.heappop(heap)
            right = nxt[pos]
            # Stale: a neighbour changed since it was pushed. (The library asks whether the pair now there merges
            # into the same piece; a symbol only grows by taking its right neighbour, so the same merged piece at
            # this position is the same pair.)
            if not alive[pos] or right >= n or ids[pos] != left_id or ids[right] != right_id:
                continue
            ids[pos] = merged
            alive[right] = False
            nxt[pos] = nxt[right]
            if nxt[pos] < n:
                prv[nxt[pos]] = pos
            if prv[pos] >= 0:
                rank = self._rank(ids[prv[pos]], merged)
                if rank is not None:
                    heapq.heappush(heap, (rank[0], rank[1], rank[2], prv[pos], rank[3]))
            if nxt[pos] < n:
                rank = self._rank(merged, ids[nxt[pos]])
                if rank is not None:
                    heapq.heappush(heap, (rank[0], rank[1], rank[2], pos, rank[3]))
        return [i for i, keep in zip(ids, alive) if keep]

    # -- decoding --------------------------------------------------------------------------------------------------

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The library's decoders for this vocabulary: "▁" -> " ", <0xNN> runs as UTF-8 (a run that is not valid
        UTF-8: one U+FFFD a byte), then one leading space stripped where a space prefix was added."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if not 0 <= i < len(self.tokens):
                continue
            added = self.added.get(i)
            if added is not None and added.special and skip_special_tokens:
                continue
            byte = None if added is not None else self._byte_of(i)
            if byte is not None:
                run.append(byte)
                continue
            if run:
                out.append(_bytes_text(run))
                run = []
            out.append(self.tokens[i].replace(SPACE, " "))
        if run:
            out.append(_bytes_text(run))
        text = "".join(out)
        return text[1:] if self.add_space_prefix and text.startswith(" ") else text

    def _byte_of(self, i: int) -> int | None:
        match = BYTE_PIECE.fullmatch(self.tokens[i])
        return int(match.group(1), 16) if match and self._byte_ids.get(int(match.group(1), 16)) == i else None


def _bytes_text(run: list[int]) -> str:
    try:
        return bytes(run).decode()
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def _trie(words: dict[str, int]) -> dict:
    root: dict = {}
    for word, i in words.items():
        node = root
        for char in word:
            node = node.setdefault(char, {})
        node[None] = i
    return root
