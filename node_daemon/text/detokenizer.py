"""Incremental detokenization with stop strings: token ids in, safe text deltas out.

Byte-level tokens can end in the middle of a UTF-8 character; decoding such a tail yields U+FFFD,
which is held back until the next token completes it (or the request ends). Text that could be the
start of a stop string is held back too, and a matched stop string is cut off and never emitted (unless
`include_stop` asks for it, as vLLM's include_stop_str_in_output). Stop strings are found by stop_matcher.py, fed
each new character once: the cost per token does not grow with their number.

Each step decodes only a short window of recent tokens (a few tokens of context before the newest
ones, so tokenizers that strip a leading space at the window start stay right): the cost per token is
constant, not growing with the output.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from stallfree.node_daemon.text.stop_matcher import StopMatcher

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 4


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """One request's output text. `add_tokens` returns what may be streamed now; `finish` the rest."""

    __slots__ = ("_tokenizer", "_ids", "_window_start", "_window_emitted", "_stops", "_include_stop",
                 "_skip_special", "text", "_sent", "stopped_by", "_dirty_tail")

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._window_start = 0
        # Characters of decode(ids[window_start:]) already turned into output text (the prompt context's).
        self._window_emitted = len(self._decode(self._ids).rstrip(_REPLACEMENT)) if self._ids else 0
        self._stops = StopMatcher(stop) if any(stop) else None
        self._include_stop = include_stop
        self.text = ""  # all output text decoded so far (held-back stop-string prefixes included)
        self._sent = 0  # characters of `text` already returned to the caller
        self.stopped_by: str | None = None  # the stop string that ended the request
        self._dirty_tail = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    @property
    def stopped(self) -> bool:
        return self.stopped_by is not None

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Feed newly sampled tokens; returns the text that is safe to stream (may be empty)."""
        if self.stopped_by is not None:
            return ""
        self._ids.extend(token_ids)
        self._append_decoded(final=False)
        return self._release()

    def finish(self) -> str:
        """The request ended (EOS, length, abort): release everything still held back."""
        if self.stopped_by is not None:
            return ""
        if self._dirty_tail:
            self._append_decoded(final=True)
        if self.stopped_by is not None:  # a completed character finished a stop string
            return self._release()
        out = self.text[self._sent:]
        self._sent = len(self.text)
        return out

    def _append_decoded(self, final: bool) -> None:
        window = self._decode(self._ids[self._window_start:])
        self._dirty_tail = window.endswith(_REPLACEMENT) and not final
        stable = window.rstrip(_REPLACEMENT) if self._dirty_tail else window
        if len(stable) > self._window_emitted:
            new = stable[self._window_emitted:]
            self._window_emitted = len(stable)
            if self._stops is not None:
                new = self._cut_at_stop(new)
            self.text += new
        if not self._dirty_tail and len(self._ids) - self._window_start > 2 * _CONTEXT_TOKENS:
            # Slide the window; its start may fall inside a character, which decodes the same every time.
            self._window_start = len(self._ids) - _CONTEXT_TOKENS
            self._window_emitted = len(self._decode(self._ids[self._window_start:]))

    def _cut_at_stop(self, new: str) -> str:
        """`new` up to a stop string it completes; a stop begun in earlier text takes that text's held-back tail too
        (never sent: the matcher's held characters are not released)."""
        match = self._stops.feed(new)
        if match is None:
            return new
        end, self.stopped_by = match
        if self._include_stop:
            return new[:end]
        start = end - len(self.stopped_by)
        if start < 0:
            self.text = self.text[:len(self.text) + start]
            return ""
        return new[:start]

    def _release(self) -> str:
        end = len(self.text) if self.stopped_by is not None else len(self.text) - self._stop_prefix_len()
        if end <= self._sent:
            return ""
        out = self.text[self._sent:end]
        self._sent = end
        return out

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of `text` that could still grow into a stop string."""
        return self._stops.held if self._stops is not None else 0
