"""One sequence's place in its grammar: which tokens may come next, and the token that came.

The engine asks fill_mask() before sampling a constrained row and accept() after. A row whose mask allows
no token, or whose sampled token the grammar refuses, is at a dead end: the engine finishes it with
FINISH_GRAMMAR_DEAD_END rather than sampling from nothing (which would loop or hang).
"""
from __future__ import annotations

import time

import llguidance
import torch

# The engine's finish_reason for a constrained sequence that can go no further; the server reports it as
# finish_reason "stop" with this as the stop_reason (OpenAI has no such reason of its own).
FINISH_GRAMMAR_DEAD_END = "grammar_dead_end"


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask (bit t%32 of word t//32 is token t)."""
    return (vocab_size + 31) // 32


class Matcher:
    """Wraps the library's matcher; not thread-safe (one sequence, one thread at a time)."""

    def __init__(self, inner: llguidance.LLMatcher, vocab_size: int, origin: str = "") -> None:
        self._inner = inner
        self.vocab_size = vocab_size
        self.origin = origin
        self.dead_end = False
        self.num_accepted = 0
        self.last_mask_s = 0.0  # how long the last fill_mask took (the engine leaves a core to slow masks)

    def fill_mask(self, bitmask_row: torch.Tensor) -> bool:
        """Write the allowed next tokens into `bitmask_row` (int32, contiguous, on the CPU, bitmask_words()
        long). False (and dead_end set) when no token is allowed."""
        if bitmask_row.dtype != torch.int32 or not bitmask_row.is_contiguous() or bitmask_row.device.type != "cpu":
            raise ValueError("a bitmask row must be a contiguous int32 CPU tensor")
        if bitmask_row.numel() != bitmask_words(self.vocab_size):
            raise ValueError(f"a bitmask row of {bitmask_row.numel()} words for a vocab of {self.vocab_size}")
        started = time.perf_counter()
        if self._inner.is_error():
            bitmask_row.zero_()
        else:
            self._inner.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), bitmask_row.numel() * 4)
        self.last_mask_s = time.perf_counter() - started
        if self._inner.is_error() or not bool(bitmask_row.any()):
            self.dead_end = True
        return not self.dead_end

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False (and dead_end set) when the grammar refuses it."""
        ok = self._inner.consume_token(int(token_id)) and not self._inner.is_error()
        if ok:
            self.num_accepted += 1
        else:
            self.dead_end = True
        return ok

    def is_terminated(self) -> bool:
        """The document is complete and nothing may follow but an end-of-sequence token (or it came)."""
        return self._inner.is_stopped()

    def is_accepting(self) -> bool:
        """What was generated so far is a complete document (an end-of-sequence token is allowed now)."""
        return self._inner.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (for speculative decoding or stop strings that cut tokens)."""
        if num_tokens > self.num_accepted or not self._inner.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens ({self.num_accepted} accepted)")
        self.num_accepted -= num_tokens
        self.dead_end = self._inner.is_error()

    @property
    def error(self) -> str:
        return self._inner.get_error() if self._inner.is_error() else ""
