"""How many output tokens KV admission reserves for a request whose own bound is larger.

A chat request without max_tokens may run to the end of the context, and reserving all of that at
admission lets only a few requests run at once. Instead the scheduler reserves an estimate: a high
quantile of the output lengths this daemon has seen, times a safety margin, never below a floor (the
idea of SGLang's new-token ratio, kept in tokens because a default max_tokens of "the whole context"
makes a ratio of it meaningless). When the estimate is short, decoding preempts by recompute.

Which lengths teach it: every request that stopped by itself (EOS, stop token or string), and every
one cut by a length limit above the estimate. A request cut by its own smaller max_tokens says nothing
about how long unbounded ones run, and an aborted one stopped for reasons outside the model.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque

from stallfree.contracts import percentile


class OutputLengthEstimate:
    def __init__(self, initial: int = 256, floor: int = 64, margin: float = 1.5, quantile: float = 0.9,
                 window: int = 256) -> None:
        if min(initial, floor) < 0 or margin < 0 or not 0.0 < quantile <= 1.0 or window < 0:
            raise ValueError("output length estimate: initial, floor, margin and window must be >= 0, "
                             f"quantile in (0, 1]; got {initial}, {floor}, {margin}, {window}, {quantile}")
        self.floor = floor
        self.margin = margin
        self.quantile = quantile
        self._window = window
        self._lengths: deque[int] = deque()  # the last `window` lengths in arrival order ...
        self._sorted: list[int] = []  # ... and the same sorted, for the quantile
        self._tokens = max(initial, floor)
        self.num_observed = 0

    @classmethod
    def fixed(cls, tokens: int) -> OutputLengthEstimate:
        """Always `tokens` (0: the prompt alone, as vLLM admits; a huge value: the request's full bound)."""
        return cls(initial=tokens, floor=tokens, window=0)

    @classmethod
    def worst_case(cls) -> OutputLengthEstimate:
        """Reserve every token a request may generate: decoding can never run out of KV."""
        return cls.fixed(1 << 40)

    @property
    def tokens(self) -> int:
        """Output tokens to reserve for a request that has generated none yet."""
        return self._tokens

    def observe(self, num_output_tokens: int, stopped: bool) -> None:
        """A request finished with this many output tokens; `stopped`: by itself rather than a length limit."""
        if self._window == 0 or not (stopped or num_output_tokens > self._tokens):
            return
        lengths, ordered = self._lengths, self._sorted
        lengths.append(num_output_tokens)
        insort(ordered, num_output_tokens)
        if len(lengths) > self._window:
            del ordered[bisect_left(ordered, lengths.popleft())]
        self.num_observed += 1
        high = percentile(ordered, self.quantile)
        self._tokens = max(self.floor, math.ceil(high * self.margin))
